"""The head's job_submit.lua, run by Lua 5.1 (the Lua Debian's and Ubuntu's Slurm link job_submit/lua against) and by
Lua 5.4 (the image's Slurm, built against the BOM's liblua5.4-dev: configure takes the newest Lua pkg-config finds),
with a stand-in for the `slurm` table Slurm gives the script: its data agree with slurm.conf, and its check refuses
what no node of a partition could run and accepts the rest. tests/integration/test_submit_check.py has a real
slurmctld run it."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from lupa import lua51, lua54

from conftest import FIXTURES, STACK_FILES
from gpucluster.render import job_submit, slurm
from gpucluster.spec.model import Stack, load_stack

# Slurm's sentinels as job_submit/lua hands them to a script (seen on 22.05 and 24.11: sbatch without the option).
NO_VAL, NO_VAL16, NO_VAL64 = 4294967294, 65534, 2.0**64 - 1
REQUESTED_NODE_CONFIG_UNAVAILABLE = 2014  # ESLURM_REQUESTED_NODE_CONFIG_UNAVAILABLE, slurm_errno.h
ERROR = -1
# A job_desc's numbers when sbatch is given nothing: what slurmctld passes for each field the check reads.
UNSET = {"cpus_per_task": NO_VAL16, "ntasks_per_node": NO_VAL16, "pn_min_cpus": NO_VAL16, "num_tasks": NO_VAL,
         "min_nodes": NO_VAL, "max_nodes": NO_VAL, "min_cpus": 1}


class Controller:
    """slurmctld's side of job_submit/lua: the script loaded into a fresh Lua state with a `slurm` table."""

    def __init__(self, stack: Stack, lua: ModuleType = lua51):
        self.lua = lua.LuaRuntime(unpack_returned_tuples=True)
        self.messages: list[str] = []
        table: dict[str, Any] = {"SUCCESS": 0, "ERROR": ERROR, "NO_VAL": NO_VAL, "NO_VAL16": NO_VAL16,
                                 "NO_VAL64": NO_VAL64,
                                 "ESLURM_REQUESTED_NODE_CONFIG_UNAVAILABLE": REQUESTED_NODE_CONFIG_UNAVAILABLE}
        self.lua.globals().slurm = self.lua.table_from(table)
        # As job_submit_lua.c defines it: slurm.user_msg(string.format(...)), the lines sbatch prints.
        self.lua.globals().user_msg = self.messages.append
        self.lua.execute("slurm.log_user = function(...) user_msg(string.format(...)) end")
        assert self.lua.execute(slurm.job_submit_lua(stack)) == 0  # what slurmctld checks after loading it

    def submit(self, **fields: Any) -> int:
        self.messages.clear()
        job_desc = self.lua.table_from({**UNSET, **fields})
        return int(self.lua.globals().slurm_job_submit(job_desc, self.lua.table(), 0))


# Each check runs in both Luas: the script is written for 5.1's semantics, and 5.3 and later differ (an integer
# subtype of number, unpack and setfenv gone from the globals).
LUAS = pytest.mark.parametrize("lua", [lua51, lua54], ids=["lua5.1", "lua5.4"])


@pytest.fixture(params=[lua51, lua54], ids=["lua5.1", "lua5.4"])
def ctld(request: pytest.FixtureRequest) -> Controller:
    return Controller(load_stack(FIXTURES / "Pulumi.local.yaml"), lua=request.param)


def data(stack: Stack) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """The rendered DEFAULT_PARTITION and PARTITIONS, read by Lua."""
    script = slurm.job_submit_lua(stack)
    assert script.endswith(job_submit.CHECK)
    lua = lua51.LuaRuntime()  # the data only: plain tables of strings and numbers
    default, partitions = lua.execute(script[:-len(job_submit.CHECK)] + "\nreturn DEFAULT_PARTITION, PARTITIONS")

    def plain(value: Any) -> Any:
        return {k: plain(v) for k, v in value.items()} if lua51.lua_type(value) == "table" else value
    return default, {name: [plain(p) for p in pools.values()] for name, pools in partitions.items()}


@pytest.mark.parametrize("path", STACK_FILES, ids=lambda p: p.name)
def test_data_are_what_slurm_conf_gives_each_partition(path: Path) -> None:
    """What the check compares a job with is what slurmctld knows: each partition's nodes and, for each, the CPUs,
    memory and accelerators of slurm.conf's node line; the default partition is slurm.conf's."""
    stack = load_stack(path)
    conf = slurm.slurm_conf(stack)
    lines = [dict(word.split("=", 1) for word in line.split()) for line in conf.splitlines()
             if line.startswith(("NodeName=", "PartitionName="))]
    nodes = {re.sub(r"-(\[1-\d+\]|1)$", "", line["NodeName"]): line for line in lines if "NodeName" in line}
    parts = {line["PartitionName"]: line for line in lines if "PartitionName" in line}
    default, partitions = data(stack)
    assert set(partitions) == set(parts)
    assert [name for name, line in parts.items() if line.get("Default") == "YES"] == [default]
    for name, pools in partitions.items():
        assert ",".join(slurm.hostlist(p["name"], 1, p["nodes"]) for p in pools) == parts[name]["Nodes"]
        for pool in pools:
            line = nodes[pool["name"]]
            assert (pool["cpus"], pool["memory_mib"]) == (int(line["CPUs"]), int(line["RealMemory"]))
            gres = [":".join([g, *([v["type"]] if "type" in v else []), str(v["count"])])
                    for g, v in pool["gres"].items()]
            assert gres == ([line["Gres"]] if "Gres" in line else [])


def test_more_gpus_per_node_than_a_node_has_are_refused_naming_the_shape(ctld: Controller) -> None:
    assert ctld.submit(tres_per_node="gres/gpu:8") == REQUESTED_NODE_CONFIG_UNAVAILABLE
    assert ctld.messages == [
        "partition spot: a node has 1 GPU (l4), 4 CPUs, 15.2 GiB (pool spot, up to 2 nodes) or "
        "1 GPU (l4), 4 CPUs, 15.2 GiB (pool standby, up to 2 nodes); the job asks 8 GPUs per node"]
    assert ctld.submit(tres_per_node="gres/gpu:2", partition="standby") == REQUESTED_NODE_CONFIG_UNAVAILABLE
    assert ctld.messages == ["partition standby: a node has 1 GPU (l4), 4 CPUs, 15.2 GiB, up to 2 nodes; "
                             "the job asks 2 GPUs per node"]


def test_cpus_memory_and_gpu_model_a_node_lacks_are_refused(ctld: Controller) -> None:
    refused: dict[str, dict[str, Any]] = {
        "160 CPUs per node": {"cpus_per_task": 160, "pn_min_cpus": 160, "min_cpus": 160},
        "6 CPUs per node": {"cpus_per_task": 2, "ntasks_per_node": 3, "pn_min_cpus": 2, "min_cpus": 6},
        "20 GiB per node": {"min_mem_per_node": 20480},
        "19.5 GiB per node": {"min_mem_per_cpu": 5000, "cpus_per_task": 4, "pn_min_cpus": 4, "min_cpus": 4},
        "1 GPU (h100) per node": {"tres_per_node": "gres/gpu:h100:1"},
        "2 GPUs per node": {"tres_per_task": "cpu=1,gres/gpu=2", "num_tasks": 2},
        "1 Neuron device per node": {"tres_per_node": "gres/neuron:1"},
    }
    for asked, fields in refused.items():
        assert ctld.submit(partition="always", **fields) == REQUESTED_NODE_CONFIG_UNAVAILABLE, asked
        assert ctld.messages[0].endswith(f"; the job asks {asked}")


def test_more_nodes_cpus_or_gpus_than_the_partition_has_are_refused(ctld: Controller) -> None:
    assert ctld.submit(partition="standby", min_nodes=3, max_nodes=3) == REQUESTED_NODE_CONFIG_UNAVAILABLE
    assert ctld.messages[0].endswith("the job asks 3 nodes")
    assert ctld.submit(partition="standby", num_tasks=9, min_cpus=9) == REQUESTED_NODE_CONFIG_UNAVAILABLE
    assert ctld.messages[0].endswith("the job asks 9 CPUs in all")
    assert ctld.submit(partition="spot", tres_per_job="gres/gpu:5") == REQUESTED_NODE_CONFIG_UNAVAILABLE
    assert ctld.messages[0].endswith("the job asks 5 GPUs in all")


def test_what_some_node_can_run_is_accepted(ctld: Controller) -> None:
    fits: list[dict[str, Any]] = [{},
            {"tres_per_node": "gres/gpu:1", "cpus_per_task": 4, "pn_min_cpus": 4, "min_mem_per_node": 15564},
            {"tres_per_node": "gres:gpu:l4:1", "partition": "always"},
            {"tres_per_task": "cpu=4,gres/gpu=1", "cpus_per_task": 4, "num_tasks": 2, "min_cpus": 8},
            {"partition": "spot", "min_nodes": 4, "max_nodes": 4},  # its fallback pool's nodes count
            {"partition": "spot", "tres_per_job": "gres/gpu:4", "num_tasks": 16, "min_cpus": 16},
            {"min_mem_per_node": 0}]  # --mem=0: all of a node's memory
    for fields in fits:
        assert ctld.submit(**fields) == 0, fields
        assert ctld.messages == []


def test_a_job_fits_if_one_of_its_partitions_can_run_it(ctld: Controller) -> None:
    assert ctld.submit(partition="always,standby", min_nodes=2) == 0
    assert ctld.submit(partition="always,standby", min_nodes=3) == REQUESTED_NODE_CONFIG_UNAVAILABLE
    assert [m.split(":")[0] for m in ctld.messages] == ["partition always", "partition standby"]


def test_what_the_check_cannot_read_is_left_to_slurm(ctld: Controller) -> None:
    assert ctld.submit(partition="nosuch", tres_per_node="gres/gpu:8") == 0  # Slurm refuses the partition itself
    assert ctld.submit(tres_per_node="gres/gpu:1k") == 0
