"""`python -m launch ...`: see `launch/__init__.py`."""
import logging
import os
import sys

from tupe_jax import allocator

if __name__ == "__main__":
    allocator.maybe_reexec()      # huge pages for XLA:CPU's buffers (tupe_jax/allocator.py); before jax starts

from absl import logging as absl_logging  # noqa: E402  (after the re-exec: nothing heavy imported twice)

from launch import main, quiet_when_stdout_closes  # noqa: E402

absl_logging.set_verbosity(absl_logging.ERROR)   # Orbax/tfds chatter; our own progress lines are prints
logging.getLogger("absl").setLevel(logging.ERROR)
# Storage clients narrate their credential fallbacks (no metadata server, anonymous access) as warnings; what
# fails is reported as our own one-line error.
for _name in ("google.auth", "google.auth._default", "gcsfs"):
    logging.getLogger(_name).setLevel(logging.ERROR)

if __name__ == "__main__":
    quiet_when_stdout_closes()    # `... | head`: the command goes on without printing
    _code = main()
    if _code == 130:   # interrupted: an interrupt that came while XLA was starting up can crash the interpreter's
        import multiprocessing.util  # teardown (SIGSEGV instead of 130); the run's files are closed or saved by now,
        multiprocessing.util._exit_function()  # pylint: disable=protected-access  # and prepare's pool is released
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)  # pylint: disable=protected-access
    sys.exit(_code)
