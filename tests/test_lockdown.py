"""The lockdown every node runs at boot (gpucluster.contract.lockdown), run for real: the exact script, in a network
namespace of its own with a stand-in for instance metadata on 169.254.169.254 (this machine is not on EC2, and
iptables' owner match works in a namespace), and in a mount namespace whose /etc is an overlay (the images' login user,
its sudo rule and its docker group are seeded there; this machine's /etc is left alone). The stand-in sits in a
namespace of its own behind a veth pair, so the node reaches it from an address of its own, as on EC2."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpucluster.contract import lockdown
from gpucluster.contract.settings import ALERTMANAGER_PORT, DCGM_HOSTENGINE_PORT, LOGIN_USER, SLURM_USER

METADATA = textwrap.dedent('''
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Metadata(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_PUT(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"token")

    HTTPServer(("169.254.169.254", 80), Metadata).serve_forever()
''')

DRIVER = textwrap.dedent('''
    import json, os, pwd, shutil, subprocess, sys

    work, scripts = sys.argv[1], sys.argv[2:]
    for top in ("/etc", "/var"):
        for d in ("up", "work"):
            os.makedirs(f"{work}{top}/{d}", exist_ok=True)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={top},upperdir={work}{top}/up,workdir={work}{top}/work", top], check=True)
    # The image's login user as Ubuntu's cloud images make it: a sudo rule from cloud-init, in docker's group.
    # And Session Manager's user as the agent left it on an image's build instance: its home under /home.
    with open("/etc/passwd", "a") as f:
        f.write("LOGIN:x:1100:1100::/home/LOGIN:/bin/bash\\nssm-user:x:1103:1103::/home/ssm-user:/bin/sh\\n"
                "EIC:x:1104:1104::/nonexistent:/usr/sbin/nologin\\n")  # as ec2-instance-connect's preinst makes it
    with open("/etc/group", "a") as f:
        f.write("LOGIN:x:1100:\\ndocker:x:1101:LOGIN\\nlxd:x:1102:someone,LOGIN\\nssm-user:x:1103:\\nEIC:x:1104:\\n")
    os.makedirs("/etc/sudoers.d", exist_ok=True)
    with open("/etc/sudoers.d/90-cloud-init-users", "w") as f:
        f.write("# Created by cloud-init\\n\\n# User rules for LOGIN\\nLOGIN ALL=(ALL) NOPASSWD:ALL\\n")
    if EXTRA_RULE:
        with open("/etc/sudoers.d/zz-extra", "w") as f:
            f.write(EXTRA_RULE + "\\n")
        os.chmod("/etc/sudoers.d/zz-extra", 0o440)
    # Instance metadata where EC2 has it: off the node, through a link of its own (a veth pair into a namespace that
    # holds 169.254.169.254), so that the node talks to it from an address of its own, as on EC2.
    server = subprocess.Popen(["unshare", "--net", "sh", "-c", 'read go && exec /usr/bin/python3 -c "$0"', SERVER],
                              stdin=subprocess.PIPE, text=True)
    import time
    while os.readlink(f"/proc/{server.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
        time.sleep(0.01)  # until unshare has made the namespace
    def ip(*args, where=None):
        subprocess.run((["nsenter", "-t", str(where), "-n"] if where else []) + ["ip", *args], check=True)
    ip("link", "add", "node0", "type", "veth", "peer", "name", "imds0", "netns", str(server.pid))
    ip("link", "set", "lo", "up"); ip("addr", "add", "10.0.0.2/24", "dev", "node0"); ip("link", "set", "node0", "up")
    ip("route", "add", "169.254.169.254/32", "dev", "node0")
    ip("link", "set", "lo", "up", where=server.pid)
    ip("addr", "add", "169.254.169.254/32", "dev", "imds0", where=server.pid)
    ip("link", "set", "imds0", "up", where=server.pid)
    ip("route", "add", "10.0.0.0/24", "dev", "imds0", where=server.pid)
    server.stdin.write("go\\n"); server.stdin.flush()
    import socket
    for _ in range(100):
        try:
            socket.create_connection(("169.254.169.254", 80), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)

    probe = ("import urllib.request\\n"
             "request = urllib.request.Request('http://169.254.169.254/latest/api/token', method='PUT', "
             "headers={'X-aws-ec2-metadata-token-ttl-seconds': '60'})\\n"
             "try:\\n    print(urllib.request.urlopen(request, timeout=5).read().decode())\\n"
             "except OSError as exc:\\n    print(type(exc).__name__, exc)\\n")
    # The runs in order (bootcmd's, then the bootstrap's). In every run after the first, each iptables call is
    # followed by a probe as the login user: no step of a re-run over the rules in force may let it through.
    os.makedirs(f"{work}/watch", exist_ok=True)
    with open(f"{work}/watch/iptables", "w") as f:
        f.write(f'#!/bin/sh\\n{shutil.which("iptables")} "$@"; rc=$?\\n'
                f'setpriv --reuid=1100 --regid=1100 --clear-groups /usr/bin/python3 -c "$PROBE" >> {work}/watched\\n'
                'exit $rc\\n')
    os.chmod(f"{work}/watch/iptables", 0o755)
    open(f"{work}/watched", "w").close()
    for number, script in enumerate(scripts):
        env = dict(os.environ, PROBE=probe, PATH=f"{work}/watch:{os.environ['PATH']}") if number else None
        done = subprocess.run(["sh", "-c", open(script).read()], capture_output=True, text=True, env=env)
        if done.returncode:
            break
    import socket
    # Stand-ins for Alertmanager (head) and DCGM's host engine (compute): the port is what counts.
    listeners = [socket.create_server(("127.0.0.1", port)) for port in (ALERTMANAGER_PORT, DCGM_PORT)]
    connect = ("import socket, sys\\ntry:\\n"
               "    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5).close()"
               "\\n    print('connected')\\nexcept OSError as exc:\\n    print(type(exc).__name__, exc)\\n")
    answers, alerts, dcgm = {}, {}, {}
    for user in ("root", "SLURM", "LOGIN", "nobody", "prometheus", "EIC"):
        entry = pwd.getpwnam(user)
        as_user = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups",
                   "/usr/bin/python3"]
        answers[user] = subprocess.run(as_user + ["-c", probe], capture_output=True, text=True).stdout.strip()
        alerts[user], dcgm[user] = (subprocess.run(as_user + ["-c", connect, str(port)], capture_output=True,
                                                   text=True).stdout.strip() for port in (ALERTMANAGER_PORT, DCGM_PORT))
    for listener in listeners:
        listener.close()
    print(json.dumps({"rc": done.returncode, "stderr": done.stderr, "answers": answers, "alerts": alerts, "dcgm": dcgm,
                      "groups": subprocess.run(["id", "-nG", "LOGIN"], capture_output=True, text=True).stdout.split(),
                      "sudoers": open("/etc/sudoers.d/90-cloud-init-users").read(),
                      "sudo": subprocess.run(["sudo", "-n", "-l", "-U", "LOGIN"], capture_output=True,
                                             text=True).stdout,
                      "ssm_user": pwd.getpwnam("ssm-user").pw_dir,
                      "ssm_sudo": subprocess.run(["sudo", "-n", "-l", "-U", "ssm-user"], capture_output=True,
                                                 text=True).stdout,
                      "rules": subprocess.run(["iptables", "-S", "GPUCLUSTER-IMDS"], capture_output=True,
                                              text=True).stdout,
                      "watched": open(f"{work}/watched").read().splitlines()}))
    server.kill()
''').replace("LOGIN", LOGIN_USER).replace("SLURM", SLURM_USER).replace("SERVER", repr(METADATA)).replace(
    "ALERTMANAGER_PORT", str(ALERTMANAGER_PORT)).replace("DCGM_PORT", str(DCGM_HOSTENGINE_PORT)).replace(
    "EIC", lockdown.EIC_USER)


def run_in_namespaces(tmp_path: Path, role: str, runs: tuple[bool, ...] = (False, True),
                      extra_rule: str = "") -> dict[str, Any]:
    """`runs`: the lockdown's runs in order, each by its `packages` (False: cloud-init's bootcmd, True: the
    bootstrap's); by default a boot's two."""
    missing = [tool for tool in ("iptables", "unshare", "setpriv", "ip") if not shutil.which(tool)]
    assert not missing, f"install {missing} (make test does)"
    scripts = []
    for number, packages in enumerate(runs):
        scripts.append(tmp_path / f"lockdown-{number}.sh")
        scripts[-1].write_text(lockdown.script(role, packages=packages))
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.replace("EXTRA_RULE", repr(extra_rule)))
    done = subprocess.run(["unshare", "--net", "--mount", "--propagation", "private", "/usr/bin/python3", str(driver),
                           str(tmp_path / "etc"), *map(str, scripts)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.mark.parametrize("role", ["head", "compute"])
def test_only_root_and_the_daemons_get_instance_metadata(tmp_path: Path, role: str) -> None:
    result = run_in_namespaces(tmp_path, role)
    assert result["rc"] == 0, result["stderr"]
    answers = result["answers"]
    assert answers["root"] == "token"  # the boot unit, the SSM and CloudWatch agents, the budget guardrail
    # The head's resume, suspend and reconciler programs run as the slurm user; nothing on a compute node does.
    assert answers[SLURM_USER] == "token" if role == "head" else "Connection refused" in answers[SLURM_USER], answers
    # Alertmanager (the packaged prometheus user) sends the head's alerts to SNS; compute nodes send none.
    assert answers["prometheus"] == "token" if role == "head" else "Connection refused" in answers["prometheus"], \
        answers
    # sshd's EC2 Instance Connect key lookup (`gpucluster ssh-proxy`): the head is the only SSH target.
    eic = answers[lockdown.EIC_USER]
    assert eic == "token" if role == "head" else "Connection refused" in eic, answers
    for user in (LOGIN_USER, "nobody"):
        assert "Connection refused" in answers[user], answers  # refused at once, not left to time out
    assert "-A GPUCLUSTER-IMDS -m owner --uid-owner 0 -j ACCEPT" in result["rules"], result["rules"]
    # The bootstrap's run over bootcmd's rules: probed after each of its iptables calls, never open to the login user.
    assert result["watched"] and all("Connection refused" in answer for answer in result["watched"]), result
    # Alertmanager's unauthenticated API on the head: Prometheus and root only (on compute nodes nothing listens).
    alerts = result["alerts"]
    if role == "head":
        assert alerts["prometheus"] == alerts["root"] == "connected", alerts
        assert all(alerts[u].startswith(("ConnectionRefusedError", "ConnectionResetError"))
                   for u in (LOGIN_USER, SLURM_USER, "nobody")), alerts
    else:
        assert all(answer == "connected" for answer in alerts.values()), alerts
    # DCGM's host engine on compute nodes: root only (a user could inject a fake XID into its cache); nothing on the
    # head listens there.
    dcgm = result["dcgm"]
    if role == "compute":
        assert dcgm["root"] == "connected", dcgm
        assert all(dcgm[u].startswith(("ConnectionRefusedError", "ConnectionResetError"))
                   for u in (LOGIN_USER, SLURM_USER, "nobody", "prometheus")), dcgm
    else:
        assert all(answer == "connected" for answer in dcgm.values()), dcgm
    # Its guard comes with the bootstrap's run, before slurmd: the user data's bootcmd (16 KiB in all) goes without.
    assert lockdown.DCGM_CHAIN not in lockdown.script(role, packages=False)


def test_the_login_user_loses_every_way_to_root(tmp_path: Path) -> None:
    result = run_in_namespaces(tmp_path, "compute")
    assert not {"docker", "lxd", "sudo"} & set(result["groups"]), result["groups"]
    assert "is not allowed to run sudo" in result["sudo"], result["sudo"]  # sudo's own answer
    # The admins' Session Manager user: sudo, and a home off the shared file system.
    assert result["ssm_user"] == lockdown.SSM_USER_HOME and "(ALL) NOPASSWD: ALL" in result["ssm_sudo"]
    assert LOGIN_USER in result["groups"]  # its own group stays
    assert f"{LOGIN_USER} ALL=" not in result["sudoers"] and "# Created by cloud-init" in result["sudoers"]


def test_the_lockdown_runs_again_at_every_boot_without_piling_up_rules(tmp_path: Path) -> None:
    """bootcmd runs it at every boot and the bootstrap once more (a failed boot's retry again): each user's rule is
    there once, the REJECT once and last."""
    result = run_in_namespaces(tmp_path, "head", runs=(False, True, True))
    assert result["rc"] == 0, result["stderr"]
    rules = result["rules"].splitlines()
    everyone = lockdown.IMDS_USERS["head"] + lockdown.BOOTSTRAP_IMDS_USERS["head"]
    assert sum(rule.endswith("-j ACCEPT") for rule in rules) == len(everyone), rules
    assert [rule for rule in rules if "REJECT" in rule] == rules[-1:], rules
    assert result["answers"]["root"] == "token" and result["answers"][LOGIN_USER] != "token"
    assert all("Connection refused" in answer for answer in result["watched"]), result["watched"]


def test_sshds_key_lookup_reaches_metadata_only_once_the_bootstrap_ran(tmp_path: Path) -> None:
    """bootcmd's run (the user data's bytes) leaves ec2-instance-connect out: SSH to the head starts working with the
    bootstrap's run, never before the lockdown is in force."""
    result = run_in_namespaces(tmp_path, "head", runs=(False,))
    assert result["rc"] == 0, result["stderr"]
    assert "Connection refused" in result["answers"][lockdown.EIC_USER], result["answers"]
    assert result["answers"][SLURM_USER] == "token", result["answers"]


def test_an_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        lockdown.script("login")


def test_a_sudo_rule_the_lockdown_cannot_remove_fails_the_boot(tmp_path: Path) -> None:
    """A rule by group (or in /etc/sudoers itself) survives the clean-up: sudo's own answer catches it, and the
    script fails, so the bootstrap fails the boot rather than serve a node its users could become root on."""
    result = run_in_namespaces(tmp_path, "compute", extra_rule=f"%{LOGIN_USER} ALL=(ALL) NOPASSWD:ALL")
    assert result["rc"] == 1 and f"{LOGIN_USER} can still use sudo" in result["stderr"], result
