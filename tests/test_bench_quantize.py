"""quantize_call (bench/quantize_shapes.py) picks the op the quantize benchmarks time (a recording op)."""

from bench.quantize_shapes import quantize_call


class RecordingOps:
    def __init__(self):
        self.calls = []

    def quantize_act_lora_down(self, *args):
        self.calls.append(("plain", args))

    def rmsnorm_quantize_act_lora_down(self, *args):
        self.calls.append(("rmsnorm", args))


def test_quantize_call_runs_the_op_it_names_with_its_inputs():
    ops = RecordingOps()
    quantize_call(ops, "x", "w", "s", "p", rmsnorm=False)()
    quantize_call(ops, "x", "w", "s", "p", rmsnorm=True)()
    assert ops.calls == [("plain", ("x", "s", "p")), ("rmsnorm", ("x", "w", 1e-6, "s", "p"))]


def test_quantize_call_defers_the_call():
    ops = RecordingOps()
    call = quantize_call(ops, "x", "w", "s", "p", rmsnorm=True)
    assert ops.calls == []
    call()
    call()
    assert len(ops.calls) == 2
