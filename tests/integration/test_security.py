"""Security on a shared node, with real users and groups (created here
with useradd/groupadd; skipped only when not root, and CI runs as root):

  - another user squats the default state directory /tmp/krex-<uid> with symlinks
  - another user squats the victim's shared-memory segment
  - a permitted peer puts someone else's pid into its slot (signal freezer)
  - a daemon shared with a group: who may run, pause and stop

The sharing model (docs/architecture.md, threat model): the daemon's user and root
may do everything; members of the daemon's group (primary or supplementary) may run
commands, take regions, pause and resume, but not stop the daemon; anyone else is
refused by the socket and segment modes and by the daemon."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until
from helpers.krex_world import Krex, proc_state
from helpers.users import REPO, User, Users, as_user, krex_argv, user_env, user_python, world_dir

from krex.node.shm import Segment

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates users, groups and daemons")

WARM_VICTIM = REPO / "tests" / "helpers" / "warm_victim.py"

# ===================================================================== state-directory squatting


def _squat_state_dir(users: Users, mode: int) -> tuple[Path, list[Path]]:
    victim, attacker = users.outsider, users.attacker
    d = Path(f"/tmp/krex-{victim.uid}")
    shutil.rmtree(d, ignore_errors=True)
    targets = []
    for name in ("precious-lock", "precious-log"):
        t = Path(f"/tmp/kx-{victim.uid}-{name}")
        t.write_text(f"{name}: the victim's data\n")
        os.chown(t, victim.uid, victim.gid)
        targets.append(t)
    # The attacker pre-creates the directory and plants symlinks to the victim's files.
    script = (
        f"import os; os.mkdir({str(d)!r}); os.chmod({str(d)!r}, {mode:#o}); "
        f"os.symlink({str(targets[0])!r}, {str(d / 'krexd.lock')!r}); "
        f"os.symlink({str(targets[1])!r}, {str(d / 'krexd.log')!r})"
    )
    p = as_user(attacker, [user_python(), "-c", script], user_env())
    assert p.returncode == 0, p.stderr
    return d, targets


@pytest.mark.parametrize(
    "cmd", [["daemon", "start", "--device", "sim"], ["run", "--device", "sim", "--", "true"]]
)
def test_squatted_default_state_dir_is_refused(users: Users, cmd: list[str]) -> None:
    victim = users.outsider
    d, targets = _squat_state_dir(users, 0o777)
    shm = f"/krex-{victim.uid}"
    try:
        p = as_user(victim, krex_argv(*cmd), user_env(KREX_SIM_SHM=f"/kxsim-{victim.uid}"))
        # Before: krexd.lock's target truncated (then the pid written into it), krexd.log's appended to.
        for t in targets:
            assert t.read_text() == f"{t.name.split('-', 2)[2]}: the victim's data\n", (t, t.read_text())
        assert "Traceback" not in p.stderr, p.stderr
        assert p.returncode != 0
        assert f"belongs to uid {users.attacker.uid}" in p.stderr and "fix:" in p.stderr, p.stderr
        assert not Path("/dev/shm" + shm).exists()
    finally:
        with contextlib.suppress(OSError):
            subprocess.run(["pkill", "-U", str(victim.uid)], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)
        for t in targets:
            t.unlink(missing_ok=True)
        Path("/dev/shm" + shm).unlink(missing_ok=True)


def test_own_state_dir_writable_by_others_is_refused_and_symlinks_never_followed(users: Users) -> None:
    victim = users.outsider
    base = world_dir()
    state = base / "state"
    state.mkdir()
    os.chown(state, victim.uid, victim.gid)
    state.chmod(0o777)
    try:
        env = user_env(
            KREX_STATE_DIR=str(state), KREX_SHM=f"/kxs-{victim.uid}", KREX_SIM_SHM=f"/kxss-{victim.uid}"
        )
        p = as_user(victim, krex_argv("daemon", "start", "--device", "sim"), env)
        assert p.returncode == 4 and "writable by everyone" in p.stderr, p.stderr
        # Private again, but with a planted symlink for the journal: never followed.
        state.chmod(0o700)
        target = base / "target"
        target.write_text("keep\n")
        os.chown(target, victim.uid, victim.gid)
        (state / "journal.jsonl").symlink_to(target)
        p = as_user(
            victim,
            krex_argv(
                "run",
                "--device",
                "sim",
                "--",
                user_python(),
                "-c",
                "import krex\nwith krex.region():\n    pass\n",
            ),
            env,
        )
        assert p.returncode == 0, p.stderr
        assert target.read_text() == "keep\n"
        log = (state / "krexd.log").read_text()
        assert "symbolic link" in log and "Traceback" not in log, log
    finally:
        as_user(
            victim,
            krex_argv("daemon", "stop"),
            user_env(KREX_STATE_DIR=str(state), KREX_SHM=f"/kxs-{victim.uid}"),
        )
        Path(f"/dev/shm/kxs-{victim.uid}").unlink(missing_ok=True)
        Path(f"/dev/shm/kxss-{victim.uid}").unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)


# ===================================================================== segment squatting


@pytest.mark.parametrize("mode", [0o666, 0o660])
def test_squatted_segment_is_refused(users: Users, mode: int) -> None:
    victim, attacker = users.outsider, users.attacker
    base = world_dir()
    state = base / "state"
    state.mkdir(mode=0o700)
    os.chown(state, victim.uid, victim.gid)
    shm = f"/krex-{victim.uid}"  # the victim's default segment name
    Path("/dev/shm" + shm).unlink(missing_ok=True)
    p = as_user(
        attacker,
        [
            user_python(),
            "-c",
            f"import os; fd = os.open('/dev/shm{shm}', os.O_CREAT | os.O_RDWR, {mode:#o}); "
            f"os.fchmod(fd, {mode:#o})",
        ],
        user_env(),
    )
    assert p.returncode == 0, p.stderr
    try:
        env = user_env(KREX_STATE_DIR=str(state), KREX_SIM_SHM=f"/kxss-{victim.uid}")
        p = as_user(victim, krex_argv("daemon", "start", "--device", "sim"), env)
        assert "Traceback" not in p.stderr, p.stderr
        # Before: the daemon used the attacker's segment, and the attacker could `krex pause` it.
        assert p.returncode == 4, p.stderr
        assert f"belongs to uid {attacker.uid}" in p.stderr and "not a KREX segment of yours" in p.stderr
        assert "rm /dev/shm" in p.stderr
        st = os.stat("/dev/shm" + shm)
        assert st.st_uid == attacker.uid and st.st_size == 0, "the victim wrote into the attacker's segment"
    finally:
        as_user(victim, krex_argv("daemon", "stop"), user_env(KREX_STATE_DIR=str(state)))
        Path("/dev/shm" + shm).unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)


def test_world_accessible_segment_is_refused_by_attachers(users: Users) -> None:
    name = f"/kxw-{os.getpid()}"
    fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_RDWR, 0o666)
    os.fchmod(fd, 0o666)
    os.close(fd)
    try:
        with pytest.raises(Exception, match="not a KREX segment of yours"):
            Segment.attach(name)
    finally:
        Segment.unlink(name)


# ===================================================================== the signal freezer


def _orphan_sleeper(u: User | None = None) -> int:
    """A process outside this test's process tree (reparented to init), optionally of user u."""
    argv = ["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"]
    kw: dict[str, Any] = {"user": u.uid, "group": u.gid} if u else {}
    out = subprocess.run(argv, capture_output=True, text=True, check=True, **kw).stdout
    return int(out.split()[0])


def _admit_and_start(sock: Path, pid: int, **kw: Any) -> dict[str, Any]:
    script = (
        "import json, socket, sys\n"
        "from krex.protocol import FrameReader, encode\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = FrameReader(s, replies=True)\n"
        "def req(m):\n"
        "    s.sendall(encode(m))\n"
        "    while True:\n"
        "        r = f.read()\n"
        "        if 'event' not in r: return r\n"
        "print(json.dumps({'admit': req({'op': 'admit', 'gpu': 0}), "
        "'started': req({'op': 'started', 'pid': int(sys.argv[2])})}))\n"
        "sys.stdin.read()\n"  # keep the slot until the test closes stdin
    )
    p = subprocess.Popen(
        [user_python(), "-c", script, str(sock), str(pid)],
        env=user_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        p.wait(10)
        raise AssertionError(f"the peer failed (exit {p.returncode}): {p.stderr.read() if p.stderr else ''}")
    res = json.loads(line)
    res["proc"] = p
    return res


@pytest.mark.parametrize("who", ["root", "member"])
def test_signal_freezer_refuses_pids_outside_the_peers_tree(users: Users, who: str) -> None:
    kx = Krex()
    victim_pid = _orphan_sleeper()  # root's, not in the peer's tree
    peer = None
    try:
        os.chmod(kx.base, 0o755)
        if who == "root":
            kx.start_daemon(freezer_name="signal", slots=4)
        else:
            d = kx.krex("daemon", "start", "--device", "sim", "--freezer", "signal", "--group", users.group)
            assert d.returncode == 0, d.stderr
        kw: dict[str, Any] = {}
        if who == "member":
            kw = {"user": users.member.uid, "group": users.member.gid, "extra_groups": users.member.groups}
        peer = _admit_and_start(kx.sock, victim_pid, **kw)
        assert peer["admit"]["ok"], peer
        st = peer["started"]
        # Before: ok, and the next region of another slot SIGSTOPped root's process.
        assert st["ok"] is False and st["kind"] == "PermissionDenied", st
        owner = kx.run("own", "regions", "-n", "2", "--sleep-ms", "200")
        assert owner.wait(60) == 0, owner.output()
        assert proc_state(victim_pid) not in ("T", "t")
        assert victim_pid not in kx.status()["slots"][0].get("pids", []) if kx.status()["slots"] else True
    finally:
        if peer is not None:
            peer["proc"].kill()
        os.kill(victim_pid, 18)
        os.kill(victim_pid, 9)
        kx.cleanup()


# ===================================================================== group-shared daemons


class Shared:
    """A root daemon shared with users.group (`krex daemon start --group`)."""

    def __init__(self, users: Users) -> None:
        self.users = users
        self.kx = Krex()
        os.chmod(self.kx.base, 0o755)
        os.chmod(self.kx.out, 0o777)
        self.env = self.kx.env()

    def start(self, *extra: str) -> None:
        p = self.kx.krex("daemon", "start", "--device", "sim", "--group", self.users.group, *extra)
        assert p.returncode == 0, p.stderr
        wait_until(lambda: self.kx.sock.exists(), 20, "the shared daemon")

    def member_env(self) -> dict[str, str]:
        e = user_env()
        for k in ("KREX_STATE_DIR", "KREX_SHM", "KREX_SIM_SHM", "KREX_SIM_TRACE", "KREX_SIM_GPUS"):
            e[k] = self.env[k]
        return e

    def krex_as(self, u: User, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return as_user(u, krex_argv(*args), self.member_env(), timeout=timeout)


@pytest.fixture
def shared(users: Users) -> Iterator[Shared]:
    s = Shared(users)
    try:
        s.start()
        yield s
    finally:
        s.kx.cleanup()


REGION_AND_CGROUP = (
    "import krex, json, os\n"
    "with krex.region() as r:\n"
    "    pass\n"
    "print(json.dumps({'grant': r.grant, 'cgroup': open('/proc/self/cgroup').read()}))\n"
)


@pytest.mark.parametrize("who", ["member", "primary"])
def test_group_members_may_run_commands_with_regions(shared: Shared, who: str) -> None:
    u = getattr(shared.users, who)
    rep = shared.kx.out / f"{who}.json"
    p = shared.krex_as(
        u, "run", "--device", "sim", "--report", str(rep), "--", user_python(), "-c", REGION_AND_CGROUP
    )
    # Before: a supplementary member was refused ("another user's daemon"); a primary-group
    # member's krex run crashed in preexec_fn (it may not write the slot's cgroup.procs).
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["grant"]["ok"] and not out["grant"]["contaminated"], out
    if shared.kx.status()["daemon"]["freezer"] != "signal":
        assert "/slot-" in out["cgroup"], out["cgroup"]  # krexd moved it into its slot before exec
    report = json.loads(rep.read_text())
    assert len(report["regions"]) == 1 and report["exit_status"] == 0, report


def test_a_group_member_admitted_prewarmed_waits_then_gets_a_clean_region(users: Users) -> None:
    """A member's command admitted pre-warmed (every slot busy, `--prewarm 1`) runs its CPU
    phase at once, waits at its first GPU call on the segment's `warm` word, which it
    reads as a member, and gets a clean region once root's command gives the slot back."""
    s = Shared(users)
    try:
        s.start("--slots-per-gpu", "1", "--prewarm", "1")
        stop = s.kx.out / "stop-root"
        holder = subprocess.Popen(
            [*krex_argv("run", "--device", "sim", "--"), sys.executable, str(WARM_VICTIM), str(s.kx.out),
             "root", "--until", str(stop)],
            env=s.member_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_until(lambda: (s.kx.out / "root.gpu").exists(), 30, "root's command to hold the GPU")
        rep = s.kx.out / "member.json"
        member = subprocess.Popen(
            krex_argv(
                "run", "--device", "sim", "--report", str(rep), "--", user_python(), "-c", REGION_AND_CGROUP
            ),
            env=s.member_env(),
            user=users.member.uid,
            group=users.member.gid,
            extra_groups=users.member.groups,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        wait_until(
            lambda: any(x["warm"] for x in s.kx.status()["slots"]), 30, "the member's pre-warmed slot"
        )
        time.sleep(0.5)
        assert member.poll() is None, member.communicate()
        stop.touch()
        out, err = member.communicate(timeout=60)
        assert member.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        assert got["grant"]["ok"] and not got["grant"]["contaminated"], got
        assert json.loads(rep.read_text())["prewarm_s"] > 0.3
        assert holder.wait(30) == 0, holder.stderr.read() if holder.stderr else ""
    finally:
        s.kx.cleanup()


def test_group_members_may_pause_but_not_stop(shared: Shared) -> None:
    m = shared.users.member
    p = shared.krex_as(m, "pause", "--gpu", "0", "--for", "30")
    assert p.returncode == 0, p.stderr
    assert shared.kx.snapshot().gates[0].closed
    p = shared.krex_as(m, "resume", "--gpu", "0")
    assert p.returncode == 0, p.stderr
    assert shared.kx.gate_open()
    p = shared.krex_as(m, "daemon", "stop")
    assert p.returncode == 4 and "only the daemon's user or root may stop it" in p.stderr, p.stderr
    assert shared.kx.status()["daemon"]["pid"]  # still running
    assert shared.kx.krex("daemon", "stop").returncode == 0  # its owner may


def test_outsiders_are_refused(shared: Shared) -> None:
    o = shared.users.outsider
    p = shared.krex_as(o, "run", "--device", "sim", "--", "true")
    assert p.returncode == 125 and "ermission denied" in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = shared.krex_as(o, "pause", "--gpu", "0")
    assert p.returncode == 4, p.stderr
    assert shared.kx.gate_open()
    # The socket's mode is the first wall; the daemon checks again behind it.
    st = shared.kx.sock.stat()
    assert oct(st.st_mode & 0o777) == "0o660" and st.st_gid == shared.users.gid
    shared.kx.state.chmod(0o755)
    shared.kx.sock.chmod(0o666)
    # The daemon may refuse (reply, close) before it reads: a send after that is EPIPE.
    script = (
        "import json, socket, sys\n"
        "from krex.protocol import FrameReader, encode\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        "try:\n"
        "    s.sendall(encode({'op': 'status'}))\n"
        "except BrokenPipeError:\n"
        "    pass\n"
        "print(json.dumps(FrameReader(s, replies=True).read()))\n"
    )
    p = as_user(o, [user_python(), "-c", script, str(shared.kx.sock)], user_env())
    assert p.returncode == 0, p.stderr
    reply = json.loads(p.stdout)
    assert reply["ok"] is False and reply["kind"] == "PermissionDenied", reply
    assert f"uid {o.uid}" in reply["error"]


def test_an_outsiders_journal_is_a_clear_permission_error(shared: Shared) -> None:
    """A user who may not read the shared state directory gets what is wrong and the fix,
    never a traceback (once a PermissionError from looking for the journal files)."""
    o = shared.users.outsider
    assert shared.kx.krex("run", "--device", "sim", "--", "true").returncode == 0
    for args in (["journal"], ["journal", "--json"]):
        p = shared.krex_as(o, *args)
        assert p.returncode == 4, (p.returncode, p.stderr)
        assert "cannot read the journal" in p.stderr and "fix:" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr, p.stderr


def _member_sibling(shared: Shared, code: str, *args: str, **env: str) -> subprocess.Popen[str]:
    """`krex run` of `python -c CODE ARGS` as the group member, on the shared daemon."""
    return subprocess.Popen(
        [*krex_argv("run", "--device", "sim", "--"), user_python(), "-c", code, *args],
        env={**shared.member_env(), **env},
        user=shared.users.member.uid,
        group=shared.users.member.gid,
        extra_groups=shared.users.member.groups,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )


def _root_region(shared: Shared) -> dict[str, Any]:
    """One region of a command of root's on the shared daemon: its grant."""
    p = subprocess.run(
        [*krex_argv("run", "--device", "sim", "--"), sys.executable, "-c", REGION_AND_CGROUP],
        env=shared.member_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    grant: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])["grant"]
    return grant


def test_a_shared_daemon_renices_no_drain_helper_of_another_user(shared: Shared) -> None:
    """krexd renices its own user's drain helpers to helper_nice for good, but not another
    user's: the record and the thread name are the command's to write, and a member must not
    win a thread of nice -10 by naming one krex-drain. (Priority lent during one drain to a
    thread inside a LIFE call is given back after it.)"""
    from helpers.sibling_scripts import HELPER_NICE_SIBLING

    out, done, ready = (shared.kx.out / n for n in ("sib.json", "sib.done", "sib.ready"))
    sib = _member_sibling(shared, HELPER_NICE_SIBLING, str(out), str(done), str(ready))
    try:
        wait_until(lambda: ready.exists() or sib.poll() is not None, 60, "the member's sibling")
        assert ready.exists(), sib.communicate()
        grant = _root_region(shared)
        assert grant["ok"] and grant["drained"] >= 1, grant  # the member's helper was asked
    finally:
        done.touch()
        _, err = sib.communicate(timeout=60)
    assert sib.returncode == 0, err
    assert json.loads(out.read_text()) == {"krex-drain": 0, "main": 0}


# A sibling that makes its first driver calls, makes argv[2], then sits inside one module load
# (KREX_SIM_LIFE_MS) while a thread samples its main thread's nice; argv[1]: what it saw.
LIFE_SIBLING = """
import ctypes, json, os, sys, threading, time
cu = ctypes.CDLL("libcuda.so.1")
ctx, mod = ctypes.c_void_p(), ctypes.c_void_p()
assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
seen, stop = [], threading.Event()
def watch():
    while not stop.is_set():
        seen.append(os.getpriority(os.PRIO_PROCESS, os.getpid()))
        time.sleep(0.001)
t = threading.Thread(target=watch)
t.start()
open(sys.argv[2], "w").close()
assert cu.cuModuleLoadData(ctypes.byref(mod), b"sim") == 0
stop.set()
t.join()
nice = os.getpriority(os.PRIO_PROCESS, os.getpid())
json.dump({"min_nice": min(seen), "nice": nice}, open(sys.argv[1], "w"))
"""


def test_a_shared_daemon_lends_no_priority_to_another_users_life_call(shared: Shared) -> None:
    """Priority lent during a drain goes to krexd's own user's processes only: a member's
    thread inside a context, module or memory call is not reniced (raising its nice back
    needs no privilege, so a boost could be kept for good), and the grant names none."""
    out, ready = shared.kx.out / "life.json", shared.kx.out / "life.ready"
    sib = _member_sibling(shared, LIFE_SIBLING, str(out), str(ready), KREX_SIM_LIFE_MS="3000")
    try:
        wait_until(lambda: ready.exists() or sib.poll() is not None, 60, "the member's sibling")
        assert ready.exists(), sib.communicate()
        time.sleep(0.3)  # inside its 3 s module load
        grant = _root_region(shared)
        assert grant["ok"] and grant["lent_priority"] == [], grant
    finally:
        _, err = sib.communicate(timeout=60)
    assert sib.returncode == 0, err
    assert json.loads(out.read_text()) == {"min_nice": 0, "nice": 0}
