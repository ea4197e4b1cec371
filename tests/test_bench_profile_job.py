"""bench/profile_job.py's idle split on hand-made profiler events: busy time inside the window the shards
held the device, and each gap put down to the innermost range open on the holding thread."""

from __future__ import annotations

from torch.autograd import DeviceType

from bench.profile_job import ON_DEVICE, encode_launches, idle_split, spread_pair


class Event:
    """The few methods of a kineto event that idle_split reads (times given in microseconds)."""

    def __init__(
        self,
        name: str,
        device: DeviceType,
        start_us: float,
        end_us: float,
        thread: int = 0,
        correlation: int = 0,
    ):
        self._name, self._device, self._thread = name, device, thread
        self._start, self._end, self._correlation = start_us, end_us, correlation

    def name(self) -> str:
        return self._name

    def device_type(self) -> DeviceType:
        return self._device

    def start_ns(self) -> int:
        return int(self._start * 1000)

    def end_ns(self) -> int:
        return int(self._end * 1000)

    def start_thread_id(self) -> int:
        return self._thread

    def correlation_id(self) -> int:
        return self._correlation


def cpu(name: str, start: float, end: float, thread: int) -> Event:
    return Event(name, DeviceType.CPU, start, end, thread)


def kernel(start: float, end: float) -> Event:
    return Event("gemm", DeviceType.CUDA, start, end)


def test_gaps_go_to_the_innermost_range_of_the_thread_holding_the_device():
    ms = 1000.0  # event times are in microseconds
    events = [
        cpu(ON_DEVICE, 0, 1000 * ms, thread=1),
        cpu("ovbatch.prepare", 0, 300 * ms, thread=1),  # gap 0-100 ms: preparing
        cpu("ovbatch.generate", 300 * ms, 900 * ms, thread=1),
        cpu("ovbatch.wait_device", 0, 1000 * ms, thread=2),  # another shard waits: never the holder
        cpu("ovbatch.settle", 950 * ms, 1300 * ms, thread=3),  # a writer: not the holder either
        cpu("ovbatch.then", 0, 120 * ms, thread=4),  # the engine's thread, encoding the next batch's clips
        cpu("ovbatch.encode", 20 * ms, 110 * ms, thread=4),
        cpu(ON_DEVICE, 1100 * ms, 1600 * ms, thread=2),  # 900-1100 ms: no shard on the device
        kernel(100 * ms, 250 * ms),
        kernel(250 * ms + 10, 900 * ms),  # 10 us after the last one: launch spacing, not idle
        kernel(1100 * ms, 1550 * ms),  # 1550-1600 ms: the holder's loop, no inner range open
        cpu("aten::mm", 400 * ms, 500 * ms, thread=1),  # not ours: ignored
    ]
    split = idle_split(events)
    assert split["window_s"] == 1.6
    assert split["busy_fraction"] == round((150 + 650 + 450) / 1600 - 10e-3 / 1600, 4)
    assert split["idle_by_range"] == {
        "no shard on the device": {"s": 0.2, "gaps": 1},
        "ovbatch.prepare": {"s": 0.1, "gaps": 1},
        "shard loop": {"s": 0.05, "gaps": 1},
    }
    assert split["host_range_s"]["ovbatch.settle"] == 0.35
    # what the other threads were inside at each gap's middle (shard 2's wait for the device is no work)
    assert split["idle_beside"] == {
        "ovbatch.prepare": {"ovbatch.encode": 0.1},
        "no shard on the device": {"ovbatch.settle": 0.2},
    }


def test_a_profile_without_a_shard_on_the_device_says_so():
    assert "skipped" in idle_split([kernel(0, 10)])


def test_the_timed_shards_spread_over_the_plan_from_its_long_rows_to_its_short_ones():
    first, second = spread_pair(list(range(20)), 4)
    assert first == [0, 5, 10, 15] and second == [2, 7, 12, 17]
    assert spread_pair(list(range(8)), 4) == ([0, 2, 4, 6], [1, 3, 5, 7])  # every shard, none twice


def test_gc_pauses_count_the_collections_of_a_run_by_generation():
    import gc

    from bench.profile_job import GcPauses

    with GcPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
    gc.collect(1)  # after the run: not counted
    report = pauses.report()
    assert report["collections"][0] >= 1 and report["collections"][2] >= 1  # at least the two asked for
    assert 0 < report["longest_s"] <= max(report["seconds"].values()) + 1e-3  # both rounded
    assert report["walked_objects"] > 0 and report["full_collection_unfrozen_s"] > 0


def test_gc_pauses_time_full_collections_frozen_and_not_and_leave_the_heap_frozen():
    import gc

    from bench.profile_job import GcPauses

    held = [[i] for i in range(200_000)]  # long-lived objects, as a worker's imports and engines
    gc.freeze()
    try:
        report = GcPauses().report()
        assert report["frozen_objects"] >= len(held) > report["walked_objects"]
        assert report["full_collection_unfrozen_s"] > report["full_collection_s"]
        assert gc.get_freeze_count() >= len(held)
    finally:
        gc.unfreeze()


def test_the_encodes_kernels_are_matched_to_their_launches():
    """Two encodes: the first launches all its kernels at once and waits on the device (launch span 0.2 of
    its 10 ms), the second launches until its end (host-bound); kernels launched elsewhere do not count."""

    def launch(at: float, correlation: int, thread: int = 4) -> Event:
        return Event("cudaLaunchKernel", DeviceType.CPU, at, at + 5, thread, correlation)

    def run(start: float, end: float, correlation: int) -> Event:
        return Event("conv", DeviceType.CUDA, start, end, correlation=correlation)

    events = [
        cpu("ovbatch.encode", 0, 10_000, thread=4),
        launch(100, 1),
        launch(2_100, 2),
        run(6_000, 8_000, 1),  # queued 5.9 ms behind other work
        run(8_000, 9_900, 2),
        cpu("ovbatch.encode", 20_000, 24_000, thread=4),
        launch(20_100, 3),
        launch(23_900, 4),
        run(20_200, 20_300, 3),
        run(24_000, 24_100, 4),
        launch(30_000, 5),  # outside an encode
        run(30_010, 30_020, 5),
        launch(1_000, 6, thread=7),  # in an encode's time, but another thread's
        run(1_010, 1_020, 6),
    ]
    report = encode_launches(events)
    assert report == {
        "encodes": 2,
        "kernels": 4,
        "host_s": 0.014,
        "launch_span_s": 0.0058,
        "device_s": 0.0041,
        "queue_ms_median": 3.0,
        "queue_ms_p90": 5.9,
    }
    assert "skipped" in encode_launches([cpu("ovbatch.encode", 0, 10, thread=4)])
