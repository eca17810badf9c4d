"""Every test run emulates an 8-device cluster on the CPU (set before JAX starts), and every test
belongs to one tier (docs/testing.md, "Tiers"):

  unit          compiles no full training step (small jax functions are fine): the fast loop,
                `python -m pytest -m unit`
  e2e           compiles and runs training steps in this process (parity against one device, reports),
                or whole sharded programs and plan searches too slow for the fast loop
  multiprocess  starts real worker processes (torchrun, the CLI, a second Python)
  slow          (beside e2e or multiprocess) the longest tests: `-m "not slow"` leaves them out

A test names its tier with a `pytestmark` line at the top of its module, or a mark of its own
where a module mixes tiers. Collection fails on a test with no tier or two, and a `unit` test
fails when it compiles a training step (counted through jax.monitoring, below).
"""
import os

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from xtrain.runtime.backends import merge_xla_flags, with_cpu_xla_flags  # noqa: E402  (jax not imported yet)

# A cold suite spends most of its time in XLA's CPU compiler, and most of that in LLVM's
# optimisation of programs that then run a few steps on tiny tensors. LLVM's -O0 halves the
# compile time (measured: 16 s -> 9 s of CPU for two parity tests); it does not reassociate
# floating point at any level (no fast-math), so the parity tolerances hold unchanged.
# Worker processes inherit these flags through XLA_FLAGS. A value set by the caller wins.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",)

# jax starts in pytest_configure, before any xtrain.init(): give it xtrain's CPU flags here
os.environ["XLA_FLAGS"] = with_cpu_xla_flags(merge_xla_flags(os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS))

import pytest  # noqa: E402
import torch  # noqa: E402

NUM_DEVICES = 8
TIERS = ("unit", "e2e", "multiprocess")
# the jitted functions of xtrain.lowering.train_step.build: the whole training and evaluation step
STEP_FUNCTIONS = ("train_step", "eval_step")
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class StepCompiles:
    """Counts XLA compilations of a training or evaluation step in this process."""

    def __init__(self):
        self.count = 0

    def __call__(self, event: str, duration: float, **meta) -> None:
        name = str(meta.get("fun_name", ""))
        if event == BACKEND_COMPILE and any(f in name for f in STEP_FUNCTIONS):
            self.count += 1


step_compiles = StepCompiles()
_COMPILES_BEFORE = pytest.StashKey[int]()


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


# A worker holds an emulated 8-device cluster, the compiled programs of its module and, for a few
# tests, worker processes of its own: 1-2.5 GB resident measured; 3 GiB each leaves headroom.
WORKER_MEMORY = 3 << 30
MAX_WORKERS = 8


def pytest_xdist_auto_num_workers(config):
    """How many workers `-n auto` (pyproject's addopts) starts: one per core this process may
    use, at most one per WORKER_MEMORY of available memory, at most MAX_WORKERS."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, _available_memory() // WORKER_MEMORY, MAX_WORKERS))


def _available_memory() -> int:
    """MemAvailable of /proc/meminfo (free plus reclaimable cache), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pytest_configure(config):
    import jax

    assert jax.device_count() == NUM_DEVICES, f"tests need {NUM_DEVICES} emulated CPU devices, got {jax.device_count()}"
    jax.monitoring.register_event_duration_secs_listener(step_compiles)


# The longest modules (seconds in a cold run on 2 cores, summed over their tests: 280 down to 90),
# run first: the workers take whole modules in collection order (pyproject: --dist loadfile
# --no-loadscope-reorder), so that the last ones to start are short and the workers end together.
LONGEST_FIRST = ("test_cost.py", "test_long_sequence.py", "test_cost_pipeline.py", "test_context_parallel.py",
                 "test_aot.py", "test_pipeline.py", "test_layer_scan.py", "test_tp_derived.py", "test_zero.py",
                 "test_multiprocess.py", "test_assembly.py", "test_block_variants.py", "test_jax_lower_bound.py",
                 "test_example.py", "test_tiers.py", "test_plans.py")


def pytest_collection_modifyitems(config, items):
    """Every test is in exactly one tier; `slow` only beside e2e or multiprocess. The longest
    modules first (LONGEST_FIRST), the rest in their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's tests keep their order
    wrong = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1 or (tiers == ["unit"] and item.get_closest_marker("slow")):
            wrong.append(f"{item.nodeid}: {tiers or 'no tier'}{' + slow' if item.get_closest_marker('slow') else ''}")
    if wrong:
        raise pytest.UsageError(f"each test needs exactly one of the markers {TIERS} (unit never with slow); add "
                                f"`pytestmark = pytest.mark.<tier>` at the module's top or mark the test: "
                                + "; ".join(wrong[:20]))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_COMPILES_BEFORE] = step_compiles.count  # before module fixtures built for this test, too
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    compiled = step_compiles.count - item.stash.get(_COMPILES_BEFORE, step_compiles.count)
    if call.when == "call" and report.passed and compiled and item.get_closest_marker("unit"):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} is marked unit but compiled {compiled} training step(s) "
                           f"({'/'.join(STEP_FUNCTIONS)}); mark it e2e (or build the piece it tests "
                           f"without a whole step)")

