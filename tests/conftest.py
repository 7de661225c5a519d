import os
import threading

import pytest
import torch

# Without a GPU, Triton kernels run in the interpreter (small shapes only). It must be set before
# any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_triton_language_once_a_launch() -> None:
    """Make the Triton interpreter patch `triton.language` once a kernel launch, not at every call.

    The interpreter (triton 3.6-3.9) runs a kernel with triton.language's builtins swapped for
    interpreted ones, and swaps them again at every call of a @triton.jit function from inside the
    kernel (an inspect.getmembers walk over the language, ~1.6 ms): the top-k kernels call helpers
    in loops, and a 20-token forward of a parity model spent a third of its 10.6 s there. Within a
    launch the swap is already in force for the modules the kernel's globals name (`tl`), so a
    device call needs it again only for other language modules (`tl.core`, from triton's own
    library functions), once. Same outputs, bit for bit; left alone where the internals differ."""
    import triton.language as tl
    from triton.runtime import interpreter

    grid, device_fn = getattr(interpreter, "GridExecutor", None), getattr(interpreter, "InterpretedFunction", None)
    if grid is None or device_fn is None or not hasattr(device_fn, "rewrite"):
        return
    launch, device_call = grid.__call__, device_fn.__call__
    state = threading.local()  # .patched: ids of the language modules swapped in the running launch
    modules: dict[int, frozenset[int]] = {}  # id(fn.__globals__) -> ids of the language modules it names

    def languages(fn) -> frozenset[int]:
        key = id(fn.__globals__)
        if key not in modules:
            modules[key] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return modules[key]

    def launch_kernel(self, *args, **kwargs):
        outer, state.patched = getattr(state, "patched", None), set(languages(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.patched = outer

    def call_in_kernel(self, *args, **kwargs):
        patched, needs = getattr(state, "patched", None), languages(self.fn)
        if patched is None or not needs <= patched:
            if patched is not None:
                patched |= needs  # the interpreter's own call swaps them in for the rest of the launch
            return device_call(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:  # as the interpreter reports errors in device functions
            raise interpreter.InterpreterError(repr(e)) from e

    grid.__call__ = launch_kernel
    device_fn.__call__ = call_in_kernel


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_language_once_a_launch()

# Under pytest-xdist (`make test` runs a worker a core) each worker keeps to one torch thread:
# intra-op threads of two workers spinning against each other on a small machine make each op many
# times slower (see one_torch_thread).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on a CPU")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one torch thread: with two, intra-op threads spin against each
    other (and against other processes on a shared CPU), making each op many times slower.
    Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
