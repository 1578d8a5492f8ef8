"""Issue 21 item 8 (DP2 part): the exchange segment must be this server's.

The segment is opened ``O_CREAT`` without ``O_EXCL`` (the second rank attaches to the first's), so
a name another user created first (or one with wider permissions) would otherwise be used: its
owner could read and forge both ranks' rows. After opening, the owner must be this effective uid and
the mode exactly 0600, else the open is refused naming the segment, and the foreign object is left
alone (never unlinked, never locked). The other uid is real: a forked child ``setuid()``s to nobody.
"""

from __future__ import annotations

import os

import pytest

from dspark_harden.dp2.native import Dp2Error, shm_name_for
from tests.dp2.test_faults import _open, _session, no_shm_leftovers  # noqa: F401 - autouse fixture

NOBODY = 65534


def _create_as(uid: int, path: str, mode: int) -> None:
    """Create ``path`` as ``uid`` in a forked child (the tests run as root)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        code = 0
        try:
            os.setgid(uid)
            os.setuid(uid)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
            os.fchmod(fd, mode)
            os.close(fd)
            os.write(w, str(os.stat(path).st_uid).encode())
        except BaseException as exc:  # noqa: BLE001
            os.write(w, repr(exc).encode())
            code = 1
        os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    out = os.read(r, 1000).decode()
    os.close(r)
    assert os.waitstatus_to_exitcode(status) == 0 and out == str(uid), out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to a second uid")
def test_segment_created_by_another_uid_is_refused_and_left_alone():
    s = _session()
    name = shm_name_for(s, "mlp")
    path = "/dev/shm" + name
    _create_as(NOBODY, path, 0o600)
    try:
        for rank in (0, 1):
            with pytest.raises(Dp2Error) as info:
                _open(s, rank=rank)
            assert info.value.name == "owned"
            msg = str(info.value)
            assert f"/dev/shm{name} is not this server's: owner uid {NOBODY} mode 0600, expected uid 0 mode 0600" in msg
        st = os.stat(path)
        assert (st.st_uid, st.st_size) == (NOBODY, 0)  # not unlinked, not resized, not initialised
    finally:
        os.unlink(path)


def test_segment_with_group_or_world_access_is_refused():
    s = _session()
    name = shm_name_for(s, "mlp")
    path = "/dev/shm" + name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.fchmod(fd, 0o666)
    os.close(fd)
    try:
        with pytest.raises(
            Dp2Error,
            match=rf"/dev/shm{name} is not this server's: owner uid {os.geteuid()} mode 0666, "
            r"expected uid \d+ mode 0600",
        ) as info:
            _open(s)
        assert info.value.name == "owned"
        assert os.path.exists(path) and os.stat(path).st_size == 0
    finally:
        os.unlink(path)


def test_own_segment_still_opens_for_both_ranks():
    s = _session()
    a = _open(s, rank=0)
    st = os.stat("/dev/shm" + a.shm_name)
    assert (st.st_uid, st.st_mode & 0o7777) == (os.geteuid(), 0o600)
    b = _open(s, rank=1)  # the attach path passes the same check
    try:
        assert not os.path.exists("/dev/shm" + a.shm_name)  # unlinked once both are mapped
    finally:
        b.close()
        a.close()
