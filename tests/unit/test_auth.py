"""Identities and permissions (``common/auth.py``), without a server: seed files are private
and kept across runs, errors never show a seed, each role's grant is what its code needs and
nothing of another role's control subjects."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from common import subjects
from common.auth import (
    ROLES,
    authorization_conf,
    ensure_identities,
    grant,
    node_identities,
    read_seed,
    redact,
    seed_file,
)
from common.errors import Unauthorized

CONTROL = {
    "kv_flush": subjects.kv_flush(),
    "weights_push": subjects.weights_push(),
    "engine_generate": subjects.engine_generate("e0"),
    "engine_abort": subjects.engine_abort("e0"),
    "env": f"{subjects.PREFIX}.env.*",
    "supervisor_stop": subjects.supervisor_stop(),
}
ALLOWED = {  # who may publish each control subject
    "kv_flush": {"engine"},
    "weights_push": {"trainer"},
    "engine_generate": {"router"},
    "engine_abort": {"router"},
    "env": {"controller", "operator"},
    "supervisor_stop": {"operator"},
}


def test_only_the_owning_roles_may_publish_control_subjects() -> None:
    for name, subject in CONTROL.items():
        holders = {r for r in ROLES if subject in grant(r, public_key="U", scope="*").publish}
        if name.startswith("engine"):  # the router's grant is the wildcard of every engine
            holders |= {
                r
                for r in ROLES
                if f"{subjects.PREFIX}.engine.*.{name.split('_')[1]}"
                in grant(r, public_key="U").publish
            }
        assert holders == ALLOWED[name], (name, holders)


def test_grants_keep_inboxes_private_and_engines_to_themselves() -> None:
    for role in ROLES:
        g = grant(role, public_key="UKEY", scope="e3")
        assert "_INBOX.UKEY.>" in g.subscribe
        assert "_INBOX.>" not in g.subscribe and ">" not in g.publish + g.subscribe
    eng = grant("engine", public_key="UKEY", scope="e3")
    assert f"{subjects.PREFIX}.engine.e3.generate" in eng.subscribe
    assert all(".engine.*." not in s for s in eng.subscribe)
    assert "$KV.engine_epochs.e3" in eng.publish and "$KV.engine_epochs.>" not in eng.publish
    client = grant("client", public_key="UKEY")
    assert not any(p.startswith(("$KV.", "$JS.ACK", "_INBOX")) for p in client.publish)
    assert not any("DURABLE" in p or "MSG.NEXT" in p for p in client.publish)
    with pytest.raises(ValueError):
        grant("root", public_key="UKEY")


def test_identities_are_private_kept_and_listed(tmp_path: Path) -> None:
    auth = tmp_path / "auth"
    first = ensure_identities(auth, node_identities(["e0", "e1"]))
    assert {i.name for i in first} >= {"engine-e0", "engine-e1", "client", "operator", "router"}
    assert stat.S_IMODE(auth.stat().st_mode) == 0o700
    for i in first:
        assert stat.S_IMODE(seed_file(auth, i.name).stat().st_mode) == 0o600
    seeds = {i.name: seed_file(auth, i.name).read_bytes() for i in first}
    again = ensure_identities(auth, node_identities(["e0", "e1", "e2"]))
    assert {i.name: i.public_key for i in again if i.name in seeds} == {
        i.name: i.public_key for i in first
    }  # kept: a restarted node's server knows the same keys
    assert {i.name: seed_file(auth, i.name).read_bytes() for i in first} == seeds
    conf = authorization_conf(again)
    assert conf.count("nkey:") == len(again) and "engine-e2" not in conf  # keys, not names
    for seed in seeds.values():
        assert seed.decode() not in conf


def test_credential_errors_name_the_file_never_its_content(tmp_path: Path) -> None:
    with pytest.raises(Unauthorized, match="does not exist"):
        read_seed(tmp_path / "missing.nk")
    with pytest.raises(Unauthorized, match="cannot read"):
        read_seed(tmp_path)
    bad = tmp_path / "bad.nk"
    bad.write_text("SUAB-not-a-seed-but-secret-looking-0123456789")
    with pytest.raises(Unauthorized) as err:
        read_seed(bad)
    assert "secret" not in str(err.value) and str(bad) in str(err.value)
    fake = "SUAB" + "C" * 54
    assert (
        redact(f"oops {fake} nats://user:pw@host:4222")
        == "oops <redacted> nats://<redacted>@host:4222"
    )
