"""The suite's lanes: every test is in exactly one, so the lanes together run each test once.

- unit: no daemon of the cluster's (the library, the renderers, the node programs against stand-ins): every test
  outside an `integration` folder, marked so here; `make test-fast`.
- slurm: a real slurmctld loads the rendered configuration (tests/integration/test_slurm_controller.py).
- rehearsal: the boot rehearsal's local clusters (tests/local_cluster.py), and the DDP example's torchrun processes
  (tests/integration/test_ddp_checkpoints.py, test_kube_job_restart.py).

A module under `integration` names its lane itself (`pytestmark`). A test with no lane, or with two, stops the run at
collection, naming it. pytest.ini registers the lanes (with --strict-markers, a misspelt lane is an error too).
"""

from __future__ import annotations

import pytest

LANES = ("unit", "slurm", "rehearsal")
INTEGRATION = "integration"


def lanes_of(item: pytest.Item) -> list[str]:
    return [lane for lane in LANES if item.get_closest_marker(lane)]


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by lane
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if INTEGRATION not in item.path.relative_to(config.rootpath).parts[:-1]:
            item.add_marker(pytest.mark.unit)
    wrong = [f"{item.nodeid}: {', '.join(lanes_of(item)) or 'no lane'}" for item in items if len(lanes_of(item)) != 1]
    if wrong:
        raise pytest.UsageError(f"every test belongs to exactly one lane of {', '.join(LANES)} (tests/lanes.py):\n  "
                                + "\n  ".join(wrong))
