"""Per-party keys (Ed25519 against a roster of public keys) and who may read ``/metrics``,
against live HTTP transports on loopback."""

from __future__ import annotations

import os
import stat

import aiohttp
import numpy as np
import pytest

from tandem.errors import AuthenticationError, ConfigError
from tandem.transports import auth, codec
from tandem.transports.base import Frame
from tandem.transports.http import FRAME_PATH, HttpConfig
from tandem.transports.keys import Roster, SigningKey, generate


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Key files of parties a, b and c (c: a roster member that is neither a nor b)."""
    folder = tmp_path_factory.mktemp("keys")
    return {n: generate(n, folder) for n in ("a", "b", "c", "a2")}


def signing(pairs, name):
    return SigningKey.from_file(pairs[name][0])


def roster(pairs, **extra):
    files = {n: [pairs[n][1]] for n in ("a", "b", "c")}
    files.update(extra)
    return Roster.from_files(files)


def keyed(pairs, me=None, **kw):
    def make(name, **more):
        return HttpConfig(
            name=name,
            signing_key=signing(pairs, me or name),
            roster=kw.get("roster") or roster(pairs),
            retry_timeout=0.5,
            backoff_base=0.005,
            **more,
        )

    return make


def good(i=0) -> Frame:
    return Frame(meta={"i": i}, arrays=(np.arange(4, dtype=np.float32),))


def test_generate_writes_a_private_key_only_its_owner_reads(tmp_path):
    key, pub = generate("leader", tmp_path)
    assert key.name == "leader.key" and pub.name == "leader.pub"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert b"PRIVATE KEY" in key.read_bytes() and b"PUBLIC KEY" in pub.read_bytes()
    with pytest.raises(ConfigError, match="exists"):
        generate("leader", tmp_path)  # never overwritten
    with pytest.raises(ConfigError, match="not a PEM private key"):
        SigningKey.from_file(pub)


def test_a_roster_refuses_one_key_under_two_names(pairs):
    with pytest.raises(ConfigError, match="its own key pair"):
        Roster.from_files({"a": [pairs["a"][1]], "b": [pairs["a"][1]]})


async def test_keyed_parties_exchange_frames_and_sign_as_themselves_only(http_pair, pairs):
    a, b = await http_pair(keyed(pairs))
    await a.send("b", "c", good(1))
    assert (await b.recv("a", "c")).meta == {"i": 1}
    await b.send("a", "c", good(2))
    assert (await a.recv("b", "c")).meta == {"i": 2}
    # c holds a roster key, and signs a frame claiming to come from a: 403 identity
    body = codec.encode(good(3).replace(sender="a", channel="c", msg_id=1))
    headers = {
        "X-Tandem-Sender": "a",
        "X-Tandem-Incarnation": "forged",
        "X-Tandem-Channel": "c",
        "X-Tandem-Msg-Id": "1",
        "X-Tandem-Chunk": "0",
        "X-Tandem-Chunks": "1",
        "X-Tandem-Offset": "0",
        "X-Tandem-Total": str(len(body)),
        "X-Tandem-Spec": "",
    }
    auth.sign(
        signing(pairs, "c"),
        "POST",
        FRAME_PATH,
        headers,
        auth.body_digest([body]),
        receiver="b",
        to=b.incarnation,
    )
    async with aiohttp.ClientSession() as s:
        async with s.post(b.url + FRAME_PATH, data=body, headers=headers) as r:
            assert r.status == 403, await r.text()
            assert "signed with the key of 'c'" in await r.text()
        # the shared-secret signature of the old mode is no key at all here
        headers = auth.sign(b"s3cret", "POST", FRAME_PATH, dict(headers), auth.body_digest([body]))
        async with s.post(b.url + FRAME_PATH, data=body, headers=headers) as r:
            assert r.status == 401
    await a.send("b", "c", good(4))  # the real a is unaffected
    assert (await b.recv("a", "c")).meta == {"i": 4}
    assert b.metrics_text().count('reason="identity"') == 1


async def test_a_party_not_holding_its_rostered_key_is_refused(http_pair, pairs):
    a, b = await http_pair(keyed(pairs), a_kw={}, b_kw={})
    impostor_cfg = keyed(pairs, me="a2")("a", peers={"b": b.url})
    from tandem.transports.http import HttpTransport

    async with HttpTransport(impostor_cfg) as impostor:
        with pytest.raises(AuthenticationError):
            await impostor.send("b", "c", good())


async def test_rotation_accepts_every_key_the_roster_lists_for_a_name(http_pair, pairs):
    both = roster(pairs, a=[pairs["a"][1], pairs["a2"][1]])
    a, b = await http_pair(keyed(pairs, roster=both), a_kw={}, b_kw={})
    await a.send("b", "c", good(1))
    from tandem.transports.http import HttpTransport

    rotated = keyed(pairs, me="a2", roster=both)("a", peers={"b": b.url})
    async with HttpTransport(rotated) as new_a:  # a's new key, listed beside the old one
        await new_a.send("b", "c2", good(2))
    assert (await b.recv("a", "c")).meta == {"i": 1}
    assert (await b.recv("a", "c2")).meta == {"i": 2}


def test_keys_and_a_secret_do_not_mix(pairs):
    with pytest.raises(ValueError, match="not both"):
        HttpConfig(name="a", secret=b"x", signing_key=signing(pairs, "a"), roster=roster(pairs))
    with pytest.raises(ValueError, match="go together"):
        HttpConfig(name="a", signing_key=signing(pairs, "a"))
    with pytest.raises(ValueError, match="metrics_listen"):
        HttpConfig(name="a", metrics_listen="nowhere")


# -- who may read /metrics --------------------------------------------------------------------


def hmac_cfg(name, **kw):
    return HttpConfig(name=name, secret=b"s3cret", retry_timeout=0.5, **kw)


async def get(url, headers=None):
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics", headers=headers or {}) as r:
            return r.status, await r.text()


async def test_metrics_refuse_strangers_and_answer_token_and_peers(http_pair):
    a, b = await http_pair(hmac_cfg, b_kw={"metrics_token": b"tok"})
    await a.send("b", "c", good())
    await b.recv("a", "c")
    for headers in (
        None,
        {"Authorization": "Bearer wrong"},
        {"X-Tandem-Sender": "a"},  # a peer's name without its signature
    ):
        status, text = await get(b.url, headers)
        assert (status, text) == (401, ""), headers
    status, text = await get(b.url, {"Authorization": "Bearer tok"})
    assert status == 200 and 'peer="a"' in text
    signed = auth.sign(
        b"s3cret", "GET", "/metrics", {"X-Tandem-Sender": "a"}, auth.EMPTY_SHA, receiver="b"
    )
    status, text = await get(b.url, signed)
    assert status == 200 and 'peer="a"' in text


async def test_metrics_on_their_own_listener_are_not_on_the_main_one(http_pair):
    a, b = await http_pair(hmac_cfg, b_kw={"metrics_listen": "0"})
    assert b.metrics_url is not None and b.metrics_url.startswith("http://127.0.0.1:")
    await a.send("b", "c", good())
    await b.recv("a", "c")
    status, text = await get(b.url, {"Authorization": "Bearer x"})
    assert (status, text) == (404, "")
    status, text = await get(b.metrics_url)
    assert status == 200 and 'peer="a"' in text


# -- configuration and the command line -------------------------------------------------------


def test_tandem_keys_generate_writes_the_pair_and_prints_one_json_line(tmp_path, capsys):
    import json

    from tandem.parties.cli.commands import main

    assert main(["keys", "generate", "leader", "--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["private_key"].endswith("leader.key") and out["public_key"].endswith("leader.pub")
    assert out["key_id"] == SigningKey.from_file(tmp_path / "leader.key").key_id
    assert main(["keys", "generate", "leader", "--out", str(tmp_path)]) == 2
    assert "exists" in capsys.readouterr().err


def test_security_section_builds_keys_and_names_its_mistakes(tmp_path, monkeypatch):
    from tandem.parties.http_security import parse_security

    for n in ("leader", "follower"):
        generate(n, tmp_path)
    toml = str(tmp_path / "p.toml")
    roster_files = {"leader": "leader.pub", "follower": ["follower.pub"]}
    sec = parse_security({"private_key": "leader.key", "public_keys": roster_files}, path=toml)
    assert sec.auth == "keys"
    settings = sec.transport_settings()
    assert settings["secret"] is None
    assert settings["signing_key"].key_id in settings["roster"].key_ids("leader")
    pem = (tmp_path / "leader.key").read_text()
    monkeypatch.setenv("LEADER_KEY", pem)
    env = parse_security({"private_key_env": "LEADER_KEY", "public_keys": roster_files}, path=toml)
    assert env.transport_settings()["signing_key"].key_id == settings["signing_key"].key_id
    with pytest.raises(ConfigError, match="security.public_keys"):
        parse_security({"private_key": "leader.key"}, path=toml)
    with pytest.raises(ConfigError, match="security.secret"):
        parse_security(
            {"private_key": "leader.key", "public_keys": roster_files, "secret": "x"}, path=toml
        )
    with pytest.raises(ConfigError, match="nobody.pub"):
        parse_security(
            {"private_key": "leader.key", "public_keys": {"leader": "nobody.pub"}}, path=toml
        )


def test_http_section_reads_the_metrics_token_from_the_environment(monkeypatch):
    from tandem.parties.config import Http, validate

    monkeypatch.setenv("TOKEN", "t0k")
    http = validate(Http, {"metrics_token_env": "TOKEN", "metrics_listen": "9100"}, path="x")
    assert http.fields() == {"metrics_token": b"t0k", "metrics_listen": "9100"}
    monkeypatch.delenv("TOKEN")
    with pytest.raises(ConfigError, match="metrics_token_env"):
        validate(Http, {"metrics_token_env": "TOKEN"}, path="x")
    with pytest.raises(ConfigError, match="metrics_listen"):
        validate(Http, {"metrics_listen": "x:y"}, path="x")


def test_keys_without_cryptography_say_which_extra(monkeypatch, tmp_path, capsys):
    import sys

    from tandem.parties.cli.commands import main

    for name in [n for n in sys.modules if n.startswith("cryptography")] + ["cryptography"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "tandem.transports.keys", raising=False)
    assert main(["keys", "generate", "x", "--out", str(tmp_path)]) == 2
    assert "pip install 'tandem[keys]'" in capsys.readouterr().err
