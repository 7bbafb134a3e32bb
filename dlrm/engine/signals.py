"""Stop a training run on Ctrl-C or SIGTERM after the step in flight, with a checkpoint.

One handler for every product's loop (DLRM's and the recommender's): the loop asks
``event.is_set()`` between steps (a stop never splits an update), saves, and the process exits
with ``exit_code``: 128 + the signal (130 for SIGINT, 143 for SIGTERM), so a scheduler sees a
stop, not a completion. A second Ctrl-C aborts at once.
"""

from __future__ import annotations

import signal
import threading


class StopOnSignals:
    """Installs the handlers on creation (call it in the main thread). Once training is over
    (``over()``), a signal changes nothing: the run completed, the process is only ending."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self._over = False
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self._over:
            return
        if self.event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        print(f"\nReceived signal {signum}: stopping after this step (Ctrl-C again to abort).", flush=True)
        self.signum = signum
        self.event.set()

    def over(self) -> None:
        self._over = True

    @property
    def exit_code(self) -> int:
        return 0 if self.signum is None else 128 + self.signum

    def exit_code_of(self, stop_reason: str) -> int:
        """The exit code of a run that ended with ``stop_reason``: a signal that came after the
        last step (while the run saved or summed up) stopped nothing."""
        return self.exit_code if stop_reason == "interrupted" else 0
