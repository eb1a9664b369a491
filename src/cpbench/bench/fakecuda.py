"""Stand-ins for CUDA streams and events, for the dry run on fake CUDA tensors: no driver is
there to create real ones, and fake tensors carry no stream work. They record what the code
asked of them (``calls``), so a test can hold the ordering a strategy declares against them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class FakeStream:
    """A CUDA stream stand-in: records what the code asked of it (no driver is there to
    create a real one; fake CUDA tensors carry no stream work anyway)."""

    def __init__(self, device=None, name="side"):
        self.device, self.name, self.calls = device, name, []

    def wait_event(self, event):
        self.calls.append(("wait_event", event))

    def record_event(self, event=None):
        event = event or FakeEvent()
        self.calls.append(("record_event", event))
        return event

    def wait_stream(self, stream):
        self.calls.append(("wait_stream", stream))

    def synchronize(self):
        pass

    def query(self):
        return True


class FakeEvent:
    def __init__(self, *args, **kwargs):
        self.calls = []

    def record(self, stream=None):
        self.calls.append(("record", stream))

    def wait(self, stream=None):
        self.calls.append(("wait", stream))

    def synchronize(self):
        pass

    def query(self):
        return True


@contextlib.contextmanager
def streams() -> Iterator[list]:
    """Within the block, torch.cuda's Stream, Event, current_stream and stream() are the
    stand-ins; yields the list of streams made current, in order."""
    default = FakeStream(name="default")
    made_current: list = []

    @contextlib.contextmanager
    def stream(s):
        made_current.append(s)
        yield s

    names = ("Stream", "Event", "current_stream", "stream")
    saved = {n: getattr(torch.cuda, n) for n in names}
    patch = {"Stream": FakeStream, "Event": FakeEvent,
             "current_stream": lambda device=None: default, "stream": stream}
    for n in names:
        setattr(torch.cuda, n, patch[n])
    try:
        yield made_current
    finally:
        for n, original in saved.items():
            setattr(torch.cuda, n, original)
