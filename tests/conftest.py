"""Test setup: where kernels run, fresh seeds, property-test profiles, GPU tests.

Without a GPU every kernel runs through Triton's CPU interpreter (``TRITON_INTERPRET=1``, set here before
triton is first imported: importing torch does not import it). With one, ``pytest -m gpu`` runs the tests
marked ``gpu`` on it; the CPU tests need the interpreter and are skipped there unless it was asked for.
"""

import atexit
import os
import shutil
import tempfile
import zlib

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile's on-disk caches, fresh for each run: a cache left by a checkout whose custom ops had another
# schema replayed its stale graph here (flashlite::flash_attention's outputs unpacked as before: IndexError).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashlite-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from .utils import free_port  # noqa: E402

# Property-based tests (tests/test_properties.py): "ci" keeps the suite within CI's budget; "long" runs many
# more examples on demand: `pytest tests/test_properties.py --hypothesis-profile=long --hypothesis-show-statistics`
# (or HYPOTHESIS_PROFILE=long). Examples are fresh on every run; a failure prints its reproduction blob.
_PROPERTY_SETTINGS = dict(deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=40, **_PROPERTY_SETTINGS)
settings.register_profile("long", max_examples=2000, **_PROPERTY_SETTINGS)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """A different, reproducible seed per test: fresh random data, never zeros. Routes of repeated attention calls
    planned by an earlier test are forgotten: tests change tuning constants (tiles) that a route fixes."""
    from flashlite.attention.api import clear_routes

    clear_routes()
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))  # str hash() changes between runs
    yield


@pytest.fixture
def small_attention_tiles(monkeypatch):
    """16 x 16 tiles for every attention kernel run through the interpreter, so that short sequences cross many
    tiles (masked edges, full tiles, ragged ends)."""
    from flashlite.attention import tuning
    from flashlite.attention.tuning import AttentionConfig, BackwardConfig

    tiles = AttentionConfig(16, 16, 4, 1)
    monkeypatch.setattr(tuning, "INTERPRETER_CONFIG", tiles)
    monkeypatch.setattr(tuning, "BACKWARD_INTERPRETER_CONFIG", BackwardConfig(tiles, tiles))


@pytest.fixture
def one_rank():
    """A gloo world of one rank: this process."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def hopper(monkeypatch):
    """The dispatch rules of the Hopper kernels (forward and backward) see a Hopper GPU (``tests.utils.HOPPER``), with
    neither kernel switched off by the environment; tensors claim CUDA through ``tests.utils.on_hopper``."""
    from flashlite.attention import backward_hopper, forward_hopper
    from flashlite.core import tiles

    from .utils import HOPPER

    for module in (tiles, forward_hopper, backward_hopper):
        monkeypatch.setattr(module, "device_info", lambda device: HOPPER)
    monkeypatch.delenv("FLASHLITE_WGMMA", raising=False)
    monkeypatch.delenv("FLASHLITE_WGMMA_BACKWARD", raising=False)


@pytest.fixture(params=["default", "one_pass", "triton"])
def backward_path(request, monkeypatch):
    """Every path of the attention backward: ``default``, on Hopper the Gluon kernels' two passes where they apply,
    else the tl kernels (the interpreter); ``one_pass``: the Gluon kernels' one pass where it applies (dense, head
    dims up to 128: ``FLASHLITE_BACKWARD_ONE_PASS=1``), else as the default; ``triton``: the tl kernels with the
    Gluon backward switched off. The last two are skipped on CPU, where they are the default case."""
    if request.param != "default" and not torch.cuda.is_available():
        pytest.skip("off a GPU the default case runs the tl kernels")
    if request.param == "one_pass":
        monkeypatch.setenv("FLASHLITE_BACKWARD_ONE_PASS", "1")
    if request.param == "triton":
        monkeypatch.setenv("FLASHLITE_WGMMA_BACKWARD", "0")
    return request.param


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests need CUDA; the others run their kernels through the interpreter, so on a GPU machine
    (where the kernels are built for the GPU) they run only when TRITON_INTERPRET=1 was set."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (pytest -m gpu on the device)")
    no_interpreter = pytest.mark.skip(reason="CPU test: runs the kernels through Triton's interpreter; "
                                             "set TRITON_INTERPRET=1 to run it on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            if not HAS_GPU:
                item.add_marker(no_gpu)
        elif HAS_GPU and not interpreted:
            item.add_marker(no_interpreter)
