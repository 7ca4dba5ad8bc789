"""cgroup v2 cannot be enforced on this host (its v2 mount has no controllers): the v2 tree's
file writes are checked against a folder laid out like cgroupfs. v1 is attacked for real
in tests/attacks/test_local_host.py."""

from __future__ import annotations

from pathlib import Path

from relay.providers.local import cgroups


def _fake_v2(tmp_path: Path) -> Path:
    mount = tmp_path / "cgroup"
    own = mount / "system.slice" / "relay.service"
    own.mkdir(parents=True)
    (mount / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (own / "cgroup.controllers").write_text("cpu memory pids\n")
    (own / "cgroup.subtree_control").write_text("")
    return mount


def test_v2_delegates_below_the_relay_and_limits_each_sandbox(tmp_path: Path) -> None:
    mount = _fake_v2(tmp_path)
    root = tmp_path / "sandboxes"
    tree = cgroups.tree_v2(root, mount, "0::/system.slice/relay.service\n", pid=4242)
    own = mount / "system.slice" / "relay.service"
    assert (own / "relay" / "cgroup.procs").read_text() == "4242"  # the relay: a leaf
    assert (own / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    parent = own / "sandboxes" / cgroups.root_key(root)
    assert tree.parents == {"memory": parent}

    limits = cgroups.GroupLimits(memory_bytes=80 << 20, pids=32, cpus=1.5)
    group = tree.create("lcl-a", limits)
    folder = parent / "lcl-a"
    assert (folder / "memory.max").read_text() == str(80 << 20)
    assert (folder / "memory.swap.max").read_text() == "0"
    assert (folder / "memory.oom.group").read_text() == "1"
    assert (folder / "pids.max").read_text() == "32"
    assert (folder / "cpu.max").read_text() == "150000 100000"
    group.add(99)
    assert (folder / "cgroup.procs").read_text() == "99"
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert group.oom_kills() == 1
    assert tree.names() == {"lcl-a"}


def test_v2_is_refused_without_delegated_controllers(tmp_path: Path) -> None:
    mount = _fake_v2(tmp_path)
    (mount / "system.slice" / "relay.service" / "cgroup.controllers").write_text("cpu\n")
    try:
        cgroups.tree_v2(tmp_path / "s", mount, "0::/system.slice/relay.service\n", pid=1)
    except OSError as exc:
        assert "memory pids" in str(exc)
    else:
        raise AssertionError("a tree without memory and pids was accepted")


def test_a_second_provider_in_the_same_process_reuses_the_leaf(tmp_path: Path) -> None:
    mount = _fake_v2(tmp_path)
    cgroups.tree_v2(tmp_path / "s", mount, "0::/system.slice/relay.service\n", pid=7)
    tree = cgroups.tree_v2(tmp_path / "s", mount, "0::/system.slice/relay.service/relay\n", pid=7)
    assert tree.parents["memory"].parent == mount / "system.slice/relay.service/sandboxes"


def test_v2_makes_its_folder_of_groups_again_when_it_went(tmp_path: Path) -> None:
    """Another process on the same sandbox root (`relay probe local`) removes the folder as
    it closes, when it finds it empty; the next sandbox makes it again, controllers on."""
    import shutil

    mount = _fake_v2(tmp_path)
    tree = cgroups.tree_v2(tmp_path / "s", mount, "0::/system.slice/relay.service\n", pid=7)
    parent = tree.parents["memory"]
    shutil.rmtree(parent)
    limits = cgroups.GroupLimits(memory_bytes=80 << 20, pids=32, cpus=1.0)
    tree.create("lcl-b", limits)
    assert (parent / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (parent / "lcl-b" / "pids.max").read_text() == "32"
