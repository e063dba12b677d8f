"""toolrl: shared internals of the tool-interleaved GRPO system."""
import atexit
import gc
import sys


def _skip_the_last_collection() -> None:
    """At exit Python's last cyclic collections walk every object still alive: with vLLM, torch and
    DeepSpeed loaded, 1-2.5 s of CPU in every process that ends, and vLLM's engine core was SIGKILLed
    after 5 s of it at every shutdown. Frozen objects are skipped; what stays uncollected goes with
    the process. Not where triton's bindings are loaded (vLLM on GPU): nanobind reports every object
    left at exit as a leak, dozens of lines. The CPU set-up does not install triton."""
    if "triton._C.libtriton" not in sys.modules:
        gc.freeze()


# Registered on the first import of toolrl, so it runs after every other exit hook (those flush and
# close what matters).
atexit.register(_skip_the_last_collection)
