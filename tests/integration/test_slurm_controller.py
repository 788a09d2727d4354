"""The rendered slurm.conf and gres.conf, loaded by a real slurmctld (the node image's release, on the rehearsal's head
node: tests/rehearsal_image.py) for every shipped stack."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import STACK_FILES
from gpucluster.contract import slurm_json
from gpucluster.render import slurm
from gpucluster.spec import cost
from gpucluster.spec.model import load_stack
from local_cluster import LocalCluster, missing_tools

pytestmark = pytest.mark.slurm


# One controller per stack, which its tests share: under xdist they stay on one worker (--dist loadgroup).
@pytest.fixture(params=[pytest.param(p, marks=pytest.mark.xdist_group(f"slurm-{p.name}")) for p in STACK_FILES],
                ids=lambda p: p.name, scope="module")
def controller(request: pytest.FixtureRequest):
    assert not missing_tools(), f"install Slurm and munge first (make test does): missing {missing_tools()}"
    stack = load_stack(request.param)
    # The daemons run as the munge and slurm users: pytest's own tmp_path (mode 0700, root) is closed to them.
    root = Path(tempfile.mkdtemp(prefix="gpucluster-slurm-"))
    root.chmod(0o755)
    ctl = LocalCluster(stack, root).start()
    yield stack, ctl
    ctl.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_controller_accepts_the_rendered_config(controller) -> None:
    stack, ctl = controller
    partitions = ctl.run("sinfo", "--noheader", "--format=%R %D %t %N").split("\n")
    got = {line.split()[0]: line.split() for line in partitions if line}
    for pool in stack.spec.pools:
        name, count, state, nodes = got[pool.name]
        assert int(count) == pool.max_nodes
        assert nodes == slurm.hostlist(pool.name, 1, pool.max_nodes)
        # Powered-down cloud nodes ("idle~") until a job asks for them.
        assert state == "idle~"
    assert ctl.run("scontrol", "show", "config").count(f"ClusterName             = {stack.cluster_name}") == 1


def test_nodes_carry_cpus_memory_and_accelerators(controller) -> None:
    stack, ctl = controller
    for pool in stack.spec.pools:
        shown = ctl.run("scontrol", "show", "node", f"{pool.name}-{pool.max_nodes}")
        assert f"CPUTot={pool.itype.vcpus}" in shown
        assert f"RealMemory={int(pool.itype.memory_mib * slurm.MEMORY_FRACTION)}" in shown
        assert re.search(rf"Gres={re.escape(slurm.gres(pool) or '(null)')}\b", shown), shown
        assert "CLOUD" in shown and "POWERED_DOWN" in shown


def test_partitions_bill_their_nodes_price_and_the_default_is_the_plans(controller) -> None:
    """Each partition's billing TRES, as slurmctld computes it from the rendered TRESBillingWeights with MAX_TRES, is
    the price of all its nodes for an hour in cents: the unit of the team's money quota
    (slurm_json.BILLING_CENTS_PER_USD). Summed instead of the largest (no MAX_TRES), it would be three times that."""
    stack, ctl = controller
    assert re.search(r"PriorityFlags\s+= .*MAX_TRES", ctl.run("scontrol", "show", "config"))
    for name, members in slurm.partitions(stack).items():
        shown = ctl.run("scontrol", "show", "partition", name)
        found = re.search(r"\bTRES=\S*\bbilling=(\d+)", shown)
        assert found, shown
        billing = int(found.group(1))
        cents = sum(cost.billed_node_hour_usd(p)[0] * p.max_nodes for p in members) * slurm_json.BILLING_CENTS_PER_USD
        assert billing == pytest.approx(cents, abs=1), shown
        assert ("Default=YES" in shown) == (name == cost.default_partition(stack)[0]), shown
