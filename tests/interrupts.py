"""Ctrl-C in tests, sent only once the main thread is inside the call under test.

A bare timer is not enough: on a busy machine the main thread can be descheduled for longer than the
timer's delay before it reaches the call, and the KeyboardInterrupt then surfaces in Python before our
code runs, so no peer is told and the peer waits out its timeout (the "lost" SIGINT of the hardening
issue). Here the signal goes out `delay` seconds after the main thread was seen executing the line
that makes the call.
"""

from __future__ import annotations

import linecache
import os
import signal
import sys
import threading
import time


def sigint_once_in(call: str, delay: float = 0.3, limit: float = 30.0) -> threading.Thread:
    """Send SIGINT to this process once its main thread executes a line containing `call`."""
    main = threading.main_thread().ident

    def run() -> None:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            frame = sys._current_frames().get(main)  # noqa: SLF001 - the documented way to see it
            if frame is not None and call in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
                time.sleep(delay)
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.01)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t
