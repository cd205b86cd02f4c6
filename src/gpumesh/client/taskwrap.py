""":data:`run_task`: the wrapper a task runs inside on an engine (Dask, Ray) and here, on
the inline backend.

It catches what the function raised and returns it with its formatted traceback, so an
exception reaches the caller as itself with a :class:`~gpumesh.errors.RemoteTraceback`
cause, whatever the engine does with errors; ``timeout=`` is enforced by waiting for the
function on a thread (Python cannot kill a thread: a timed-out function keeps running
until it returns, the caller gets :class:`~gpumesh.errors.TaskTimeout` at once).
"""

from __future__ import annotations

from collections.abc import Callable

from .. import portable

# Compiled from source into a module that cannot be imported, so every engine's
# cloudpickle ships it by value: workers need not have gpumesh installed.
_TASK_SRC = '''
def run_task(fn, args, kwargs, timeout, local=False):
    """Run fn(*args, **kwargs) -> ("ok", value) | ("raised", exc or None, type name,
    message, traceback text) | ("exit", code) | ("timeout", seconds).

    On a worker (local=False) decorated calls inside the function run inline
    (GPUMESH_IN_TASK) and an exception goes as portable_exception makes it (None: it
    cannot travel). Here
    (local=True, the inline backend) the caller's environment is left alone, the
    exception is kept whatever it is, and Ctrl+C interrupts the call as it would any."""
    import os, threading, traceback
    box = {}

    def call():
        previous = os.environ.get("GPUMESH_IN_TASK")
        if not local:
            os.environ["GPUMESH_IN_TASK"] = "1"  # decorated calls inside the task run inline
        try:
            box["r"] = ("ok", fn(*args, **kwargs))
        except SystemExit as e:
            box["r"] = ("exit", repr(e.code))
        except BaseException as e:
            if local and isinstance(e, KeyboardInterrupt):
                raise  # Ctrl+C here stops the caller, as it would a plain call
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
            exc = e
            if not local:
                try:
                    try:
                        import cloudpickle as cp
                    except ImportError:
                        from ray import cloudpickle as cp
                    # itself, or a stand-in that loads as it (gpumesh.portable); None:
                    # it cannot travel, the caller gets a RemoteError
                    exc = portable_exception(e, cp.dumps, cp.loads)
                except BaseException:
                    exc = None
            e.__traceback__ = None
            box["r"] = ("raised", exc, type(e).__qualname__, str(e), tb)
        finally:
            if not local:
                if previous is None:
                    os.environ.pop("GPUMESH_IN_TASK", None)
                else:
                    os.environ["GPUMESH_IN_TASK"] = previous

    if timeout is None:
        call()
        return box["r"]
    t = threading.Thread(target=call, name="gpumesh-task", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        return ("timeout", timeout)
    return box["r"]
'''
# (portable_exception: gpumesh.portable's, copied by value along with run_task)
_ns: dict = {"__name__": "_gpumesh_engine_task", **portable.by_value()}
exec(compile(_TASK_SRC, "<gpumesh task wrapper>", "exec"), _ns)
run_task: Callable = _ns["run_task"]
