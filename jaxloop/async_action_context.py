"""Errors of background work, re-raised on the training thread at the next loop boundary
(`OuterLoop` waits for all of it when training ends). An action uploading in the background::

    class UploadAction(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            async_action_context.get_async_action_context().submit(
                'upload', upload, workdir, int(state.step))
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

Future = futures.Future

log = logging.getLogger(__name__)


class MutexLock:
    """Holds `mutex` for the duration of a ``with`` block (google/jaxloop's name)."""

    def __init__(self, mutex: threading.Lock | threading.RLock):
        self.mutex = mutex

    def __enter__(self) -> MutexLock:
        self.mutex.acquire()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.mutex.release()


class AsyncActionContext:
    """The futures of background work whose errors must reach the training thread.
    Checking forgets every future it looked at, so each error is raised (or logged) once."""

    def __init__(self) -> None:
        self._futures: list[tuple[str, Future[Any]]] = []
        self._mutex = threading.Lock()

    @property
    def futures(self) -> list[tuple[str, Future[Any]]]:
        """A copy of the registered ``(name, future)`` pairs, oldest first."""
        with self._mutex:
            return list(self._futures)

    def add_future(self, future_name: str, future: Future[Any]) -> None:
        """Registers `future`; `future_name` says in error notes which work failed."""
        if not isinstance(future, Future):
            raise TypeError(f"add_future({future_name!r}, ...) needs a concurrent.futures.Future, "
                            f"got {type(future).__name__}")
        with self._mutex:
            self._futures.append((future_name, future))

    def add_exception(self, future_name: str, exception: BaseException) -> Future[Any]:
        """Registers work that has already failed with `exception`; returns its future."""
        future: Future[Any] = Future()
        future.set_exception(exception)
        self.add_future(future_name, future)
        return future

    def submit(self, future_name: str, fn: Callable[..., Any], *args: Any,
               **kwargs: Any) -> Future[Any]:
        """Runs ``fn(*args, **kwargs)`` on a daemon thread and registers its future."""
        future: Future[Any] = Future()

        def work() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # reported through the future, on the loop's thread
                future.set_exception(e)
            else:
                future.set_result(result)

        self.add_future(future_name, future)
        threading.Thread(target=work, name=f"jaxloop-async: {future_name}", daemon=True).start()
        return future

    def discard(self, future: Future[Any]) -> bool:
        """Forgets `future`; returns whether it was still registered (not yet checked)."""
        with self._mutex:
            kept = [pair for pair in self._futures if pair[1] is not future]
            found, self._futures = len(kept) < len(self._futures), kept
        return found

    def check_exceptions_and_raise(self, raise_exception: bool = True, wait: bool = True) -> None:
        """Raises the first failed future's exception after logging the other failures (with
        ``raise_exception=False`` logs all), forgetting the futures; ``wait=False`` looks only
        at those already done."""
        with self._mutex:
            checked = [(name, f) for name, f in self._futures if wait or f.done()]
        futures.wait([f for _, f in checked])
        with self._mutex:
            done = {id(f) for _, f in checked}
            self._futures = [(n, f) for n, f in self._futures if id(f) not in done]
        failures = [(name, error) for name, future in checked
                    if not future.cancelled() and (error := future.exception()) is not None]
        for name, error in failures[1:] if raise_exception else failures:
            log.error("Background work %r failed:", name, exc_info=error)
        if not (raise_exception and failures):
            return
        name, error = failures[0]
        note = f"The exception above was raised by background work: {name}."
        if len(failures) > 1:
            others = ", ".join(repr(n) for n, _ in failures[1:])
            note += (f" {len(failures) - 1} other background failure(s) were logged with "
                     f"their tracebacks: {others}.")
        if note not in getattr(error, "__notes__", ()):
            error.add_note(note)
        raise error


_context = AsyncActionContext()


def get_async_action_context() -> AsyncActionContext:
    """The process-wide `AsyncActionContext` that loop boundaries check."""
    return _context
