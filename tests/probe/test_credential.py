"""The key reader (R-P7): what a credential file may look like, and that the key never shows."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from sidecar.credential import CredentialError, Secret, read_credential

KEY = "sk-cred-4f9a0c2b7e1d"


def write_key(path: Path, data: bytes, mode: int = 0o600) -> str:
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize(
    "data",
    [
        KEY.encode(),
        KEY.encode() + b"\n",
        KEY.encode() + b"\r\n",
        KEY.encode() + b"  \r\n",
        KEY.encode() + b"\n\n",
    ],
)
def test_r_p7_trailing_cr_lf_and_spaces_are_trimmed(tmp_path: Path, data: bytes) -> None:
    assert read_credential(write_key(tmp_path / "k", data)).reveal() == KEY


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (b"\r\n", "empty"),
        (b"   \n", "empty"),
        (b"sk-cred part2\n", "whitespace"),
        (b" " + KEY.encode(), "whitespace"),
        (b"sk-cred\tpart2", "whitespace"),
        (b"sk-cred\npart2\n", "whitespace"),
        (b"sk-cred\x00part2", "control"),
        ("sk-cr\u00e9d".encode(), "non-ASCII"),
        (b"k" * 4097, "larger than 4096"),
    ],
)
def test_r_p7_bad_key_contents_are_refused_without_showing_them(
    tmp_path: Path, data: bytes, match: str
) -> None:
    with pytest.raises(CredentialError, match=match) as info:
        read_credential(write_key(tmp_path / "k", data))
    message = str(info.value)
    assert "sk-cred" not in message and "part2" not in message


def test_r_p7_key_of_exactly_4096_bytes_is_accepted(tmp_path: Path) -> None:
    assert len(read_credential(write_key(tmp_path / "k", b"k" * 4096)).reveal()) == 4096


@pytest.mark.parametrize("mode", [0o604, 0o644, 0o606, 0o664])
def test_r_p7_file_accessible_to_all_users_is_refused_like_openssh(
    tmp_path: Path, mode: int
) -> None:
    path = write_key(tmp_path / "k", KEY.encode(), mode)
    with pytest.raises(CredentialError, match=f"mode 0{mode:o}.*chmod 600"):
        read_credential(path)


@pytest.mark.parametrize("mode", [0o640, 0o660, 0o440])
def test_r_p7_group_readable_file_is_refused(tmp_path: Path, mode: int) -> None:
    path = write_key(tmp_path / "k", KEY.encode(), mode)
    refused = f"readable by its group.*0{mode:o}.*chmod 600"
    with pytest.raises(CredentialError, match=refused) as info:
        read_credential(path)
    assert KEY not in str(info.value)


def test_r_p7_owner_only_read_is_accepted(tmp_path: Path) -> None:
    assert read_credential(write_key(tmp_path / "k", KEY.encode(), 0o400)).reveal() == KEY


def test_r_p7_symlink_is_refused_even_to_a_good_file(tmp_path: Path) -> None:
    target = write_key(tmp_path / "real.key", KEY.encode())
    link = tmp_path / "link.key"
    link.symlink_to(target)
    with pytest.raises(CredentialError, match="symlink"):
        read_credential(str(link))


def test_r_p7_directory_is_not_a_regular_file(tmp_path: Path) -> None:
    d = tmp_path / "keydir"
    d.mkdir(mode=0o700)
    with pytest.raises(CredentialError, match="not a regular file"):
        read_credential(str(d))


def test_r_p7_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(CredentialError, match="not a regular file"):
        read_credential(str(fifo))  # a blocking open would hang here (no writer)


def test_r_p7_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(CredentialError, match="cannot be opened: No such file"):
        read_credential(str(tmp_path / "absent.key"))


def test_r_p7_relative_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CredentialError, match="absolute path"):
        read_credential("provider.key")


def test_r_p7_systemd_credential_is_read_from_credentials_directory(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir(mode=0o700)
    write_key(creds / "local-inference.key", KEY.encode() + b"\n", 0o400)
    secret = read_credential(
        "systemd-credential:local-inference.key", credentials_directory=str(creds)
    )
    assert secret.reveal() == KEY


def test_r_p7_systemd_credential_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_key(tmp_path / "router", KEY.encode())
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    assert read_credential("systemd-credential:router").reveal() == KEY


def test_r_p7_systemd_credential_without_directory_is_explained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    with pytest.raises(CredentialError, match=r"\$CREDENTIALS_DIRECTORY"):
        read_credential("systemd-credential:router")


@pytest.mark.parametrize("name", ["", "../etc/shadow", "a/b", ".."])
def test_r_p7_systemd_credential_name_is_one_component(tmp_path: Path, name: str) -> None:
    with pytest.raises(CredentialError, match="one path component"):
        read_credential(f"systemd-credential:{name}", credentials_directory=str(tmp_path))


def test_r_p7_secret_never_shows_the_key() -> None:
    secret = Secret(KEY)
    percent = "%s %r" % (secret, secret)  # noqa: UP031 (how logging formats)
    shown = [repr(secret), str(secret), f"{secret}", f"{secret!r}", percent, repr([secret])]
    assert all(KEY not in text for text in shown)
    assert repr(secret) == "Secret(****)"
    assert secret.reveal() == KEY
    with pytest.raises(TypeError):
        pickle.dumps(secret)


@pytest.mark.parametrize("mode", [0o440, 0o400, 0o640])
@pytest.mark.parametrize("form", ["systemd-credential", "absolute-path"])
def test_r_p7_a_systemd_credential_copy_is_not_told_to_chmod(
    tmp_path: Path,
    mode: int,
    form: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """systemd makes the files in $CREDENTIALS_DIRECTORY itself, read-only and
    private to the service: 'chmod 600' is advice the operator cannot follow."""
    creds = tmp_path / "credentials"
    creds.mkdir()
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    path = write_key(creds / "key_local-inference", KEY.encode(), mode)
    spec = "systemd-credential:key_local-inference" if form == "systemd-credential" else path
    caplog.set_level("DEBUG", logger="gateway_capacity.credential")
    assert read_credential(spec).reveal() == KEY
    assert [r.getMessage() for r in caplog.records if r.levelname != "DEBUG"] == []


def test_r_p7_a_group_readable_file_beside_the_credentials_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = tmp_path / "credentials"
    (creds / "sub").mkdir(parents=True)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    path = write_key(creds / "sub" / "k", KEY.encode(), 0o440)  # not systemd's own copy
    with pytest.raises(CredentialError, match="chmod 600"):
        read_credential(path)


def test_r_p7_a_world_readable_systemd_credential_is_refused_without_chmod_advice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = tmp_path / "credentials"
    creds.mkdir()
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    write_key(creds / "key_p", KEY.encode(), 0o444)
    with pytest.raises(CredentialError, match="all users") as info:
        read_credential("systemd-credential:key_p")
    assert "chmod" not in str(info.value) and "LoadCredential=" in str(info.value)


# --- another local user's files: the attacker really runs as nobody ------------------------

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from as_nobody import NOBODY, as_nobody, public_dir  # noqa: E402

__all__ = ["public_dir"]  # a fixture


@pytest.fixture
def sticky_dir(public_dir: Path) -> Path:
    """A root-owned directory like /tmp: everyone may create files, sticky."""
    directory = public_dir / "shared"
    directory.mkdir()
    directory.chmod(0o1777)
    return directory


def test_r_p7_a_key_file_another_user_planted_is_refused_naming_its_owner(
    sticky_dir: Path,
) -> None:
    planted = sticky_dir / "provider.key"

    def plant() -> None:
        fd = os.open(planted, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"sk-planted-by-nobody\n")
        os.close(fd)

    as_nobody(plant)
    assert planted.stat().st_uid == NOBODY
    with pytest.raises(CredentialError) as info:
        read_credential(str(planted))
    assert str(info.value) == (
        f"credential file {planted} is owned by uid 65534 (nobody), not root or this user "
        "(uid 0 (root))"
    )
    assert "sk-planted" not in str(info.value)


def test_r_p7_a_key_in_a_directory_others_can_write_is_refused_naming_the_directory(
    public_dir: Path,
) -> None:
    open_dir = public_dir / "keys"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # no sticky bit: nobody may rename our key away and put theirs
    key = write_key(open_dir / "provider.key", KEY.encode())

    def swap() -> None:
        os.rename(key, key + ".old")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(key)
        os.rename(key + ".old", key)

    as_nobody(swap)  # it could: that is why the directory is refused
    with pytest.raises(CredentialError) as info:
        read_credential(key)
    assert f"directory {open_dir} is writable by group or others without the sticky bit" in str(
        info.value
    )
    assert KEY not in str(info.value)


def test_r_p7_a_symlinked_directory_another_user_controls_is_refused(
    public_dir: Path, sticky_dir: Path
) -> None:
    """nobody's directory with a link to root's private keys: root must not read through it
    and send a root-only file as the bearer key."""
    private = public_dir / "private"
    private.mkdir(mode=0o700)
    secret = write_key(private / "root-only.key", KEY.encode())
    trap = sticky_dir / "trap"

    def make_trap() -> None:
        os.mkdir(trap, 0o755)
        os.symlink(str(private), str(trap / "keys"))

    as_nobody(make_trap)
    via_link = str(trap / "keys" / "root-only.key")
    assert os.path.realpath(via_link) == secret
    with pytest.raises(CredentialError) as info:
        read_credential(via_link)
    assert f"directory {trap} is owned by uid 65534 (nobody)" in str(info.value)
    assert KEY not in str(info.value)


def test_r_p7_a_symlinked_directory_in_root_owned_directories_is_accepted(
    tmp_path: Path,
) -> None:
    """/var/run -> /run style links are fine: only root could swap them."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    write_key(real / "k", KEY.encode())
    (tmp_path / "link").symlink_to(real)
    assert read_credential(str(tmp_path / "link" / "k")).reveal() == KEY
