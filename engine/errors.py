"""Typed errors. Each message names the offending value and says what to do about it."""


class OVBatchError(Exception):
    """Base of every error this project raises on purpose."""


class CheckpointError(OVBatchError):
    """A checkpoint directory (official or W4A4) is missing, malformed or inconsistent."""


class TokenizerError(CheckpointError):
    """tokenizer.json is missing or lacks the OmniVoice special tokens."""


class InputError(OVBatchError, ValueError):
    """A request field is invalid: empty text, unknown language, bad instruct, bad duration or speed."""


class AudioError(InputError):
    """A reference clip cannot be used: unreadable, corrupt, empty, silent, too short or too long."""


class ClipReadError(AudioError):
    """A reference clip's file cannot be read (missing, no permission, an I/O error). Unlike a clip's content,
    that can change between a job's planning and its run, so a job fails the row there instead of rejecting
    it: a rerun tries it again."""


class QuantError(OVBatchError):
    """Quantization input or a W4A4 file is unusable."""


class BackendUnavailable(OVBatchError):
    """A requested fast path (attention backend, CUDA kernel) cannot run here; the message says why."""
