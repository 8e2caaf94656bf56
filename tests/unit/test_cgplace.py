"""Where slot groups go (krex/node/cgplace.py): the path arithmetic between /proc/PID/cgroup,
mountinfo and the mounted tree, the names, the notes and the registry of nested groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from krex.node import cgplace

M = "/sys/fs/cgroup"


@pytest.mark.parametrize(
    ("cg", "root", "base", "want"),
    [
        ("/job-1/step-0", "/", (), f"{M}/job-1/step-0"),
        ("/", "/", (), M),
        # a mount of a subtree (a container's own cgroup mounted as its /sys/fs/cgroup)
        ("/kubepods/pod1/ctr", "/kubepods/pod1", (), f"{M}/ctr"),
        ("/kubepods/pod2/ctr", "/kubepods/pod1", (), None),
        # a container shown the host's tree from above its cgroup namespace ("/.."s)
        ("/../job-1/step-0", "/..", (), f"{M}/job-1/step-0"),
        ("/../step-0", "/../..", (), None),  # below the namespace's ancestors: needs `base`
        ("/../step-0", "/../..", ("job", "krexd"), f"{M}/job/step-0"),
        ("/../../job-1/step-0", "/../..", ("pods", "krexd"), f"{M}/job-1/step-0"),
        ("/", "/../..", ("pods", "krexd"), f"{M}/pods/krexd"),
        ("/../../../x", "/../..", ("pods", "krexd"), None),
        ("/job-1/gone (deleted)", "/", (), None),
    ],
)
def test_dir_in_mount(cg: str, root: str, base: tuple[str, ...], want: str | None) -> None:
    assert cgplace.dir_in_mount(cg, M, root, base) == want
    if want is not None:  # and back, as /proc/PID/cgroup would name it
        assert cgplace.proc_path(want, M, root, base) == cg


def test_names() -> None:
    assert cgplace.nested_name("krex-node", "slot-3") == "krex-krex-node-slot-3"
    assert cgplace.nested_name("a/b", "slot-0") == "krex-a-b-slot-0"
    assert cgplace.is_slot_dir("slot-12") and cgplace.is_slot_dir("krex-x-slot-1")
    assert not cgplace.is_slot_dir("slot-12", nested_only=True)
    assert not cgplace.is_slot_dir("step-0") and not cgplace.is_slot_dir("krex-x-slot-")


def test_placement_notes() -> None:
    ok = cgplace.Placement(f"{M}/job/krex-r-slot-0", "/job", "caller")
    assert ok.note == "" and ok.as_dict() == {"group": ok.group, "caller": "/job", "placement": "caller"}
    assert cgplace.Placement(f"{M}/r/slot-0", "", "none").note == ""
    fb = cgplace.Placement(f"{M}/r/slot-0", "/job", "root", "cannot create cgroup x: Permission denied")
    assert fb.note.startswith("krex: warning:") and "/job" in fb.note and "Permission denied" in fb.note
    assert "outside" in fb.note and fb.as_dict()["note"] == fb.note and fb.as_dict()["placement"] == "root"
    svc = cgplace.Placement(f"{M}/krexd.service/krex-r-slot-0", "/job", "daemon", "why")
    assert "krexd's own delegated cgroup subtree" in svc.note


def test_service_cgroup_needs_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    assert cgplace.service_cgroup(True) is None


def test_registry_lists_adds_drops_and_ignores_planted_entries(tmp_path: Path) -> None:
    reg = cgplace.Registry(tmp_path / "freezer" / "r" / "cgroup2-groups.json", M, "r")
    good = f"{M}/job/krex-r-slot-3"
    reg.add(good, "slot-3")
    assert reg.load() == {good: "slot-3"}
    planted = {
        good: "slot-3",
        f"{M}/system.slice": "slot-1",  # not a slot group's name
        f"{M}/job/../x/krex-r-slot-2": "slot-2",  # not normalised
        "/etc/krex-r-slot-4": "slot-4",  # not in the mount
        f"{M}/job/krex-r-slot-5": "slot-6",  # the name says another slot
        f"{M}/job/krex-r-slot-7": "bin",
    }
    reg.path.write_text(json.dumps({"groups": planted}))
    assert reg.load() == {good: "slot-3"}
    reg.drop(good)
    assert reg.load() == {} and not reg.path.exists()
    reg.path.write_text("not json")
    assert reg.load() == {}
