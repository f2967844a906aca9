"""Tokens: episode tokens signed with the run secret, the authorization matrix, redaction."""

from __future__ import annotations

import base64
import json
import secrets

import pytest

from ajet_hpc.server.auth import (
    RUN_TOKEN_TTL_S,
    AuthError,
    EpisodeClaims,
    Forbidden,
    Unauthorized,
    _Verified,  # the cache of verified tokens
    authorize_episode_call,
    authorize_run_call,
    bearer_token,
    is_run_secret,
    issue_episode_token,
    mint_challenge,
    redact,
    run_token,
    verify_episode_token,
    verify_run_token,
)

SECRET = "ab" * 32
NOW = 1_700_000_000.0


def _token(episode: str = "ep-7", model: str = "policy", ttl_s: float = 60.0) -> str:
    return issue_episode_token(SECRET, episode, model, ttl_s, now=NOW)


def _run_token(secret: str = SECRET) -> str:
    server_nonce, _ = mint_challenge(secret, "c" * 32, "http://server:1", now=NOW)
    return run_token(secret, "c" * 32, server_nonce)


def _payload(token: str) -> str:
    part = token.split(".")[1]
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)).decode()


def test_issue_then_verify_gives_the_claims() -> None:
    token = _token(ttl_s=59.5)
    assert token.startswith("ep1.") and token.count(".") == 2 and "=" not in token
    assert _payload(token) == '{"e":"ep-7","m":"policy","x":1700000060}'
    assert verify_episode_token(SECRET, token, now=NOW + 59) == EpisodeClaims("ep-7", "policy", NOW + 60)


def test_expired_token_is_refused() -> None:
    with pytest.raises(Unauthorized, match="expired"):
        verify_episode_token(SECRET, _token(ttl_s=60), now=NOW + 60)


def test_token_of_another_secret_is_forged() -> None:
    token = issue_episode_token(secrets.token_hex(32), "ep-7", "policy", 60, now=NOW)
    with pytest.raises(Unauthorized, match="signature") as caught:
        verify_episode_token(SECRET, token, now=NOW)
    assert token not in str(caught.value) and token.split(".")[2] not in str(caught.value)


def test_tampered_payload_is_refused() -> None:
    version, _, signature = _token().split(".")
    payload = json.dumps({"e": "ep-8", "m": "policy", "x": NOW + 60}, separators=(",", ":"), sort_keys=True)
    forged_payload = base64.urlsafe_b64encode(payload.encode()).rstrip(b"=").decode()
    with pytest.raises(Unauthorized, match="signature"):
        verify_episode_token(SECRET, f"{version}.{forged_payload}.{signature}", now=NOW)


@pytest.mark.parametrize("token", ["", "ep1.abc", "ep2.abc.def", "ep1..sig", "sk-123", "a.b.c.d"])
def test_malformed_tokens_are_refused(token: str) -> None:
    with pytest.raises(Unauthorized, match="malformed"):
        verify_episode_token(SECRET, token, now=NOW)


def test_issue_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        issue_episode_token(SECRET, "ep", "policy", 0)
    with pytest.raises(ValueError, match="secret"):
        issue_episode_token("", "ep", "policy", 10)
    with pytest.raises(ValueError, match="episode_id"):
        issue_episode_token(SECRET, "", "policy", 10)


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("  bearer   abc ") == "abc"
    for header in (None, "", "   "):
        with pytest.raises(Unauthorized, match="missing bearer token"):
            bearer_token(header)
    for header in ("Basic dXNlcjpwdw==", "Bearer", "Bearer   ", "abc"):
        with pytest.raises(Unauthorized, match="malformed Authorization header"):
            bearer_token(header)


def test_run_secret_compare() -> None:
    assert is_run_secret(SECRET, SECRET)
    assert not is_run_secret(SECRET, SECRET[:-1] + "c")
    assert not is_run_secret(SECRET, "")
    assert not is_run_secret("", "")
    assert not is_run_secret(SECRET, "é" * 64)


def test_episode_call_with_its_token_is_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("time.time", lambda: NOW + 1)
    header = f"Bearer {_token()}"
    assert authorize_episode_call(SECRET, header, "ep-7", "policy").episode_id == "ep-7"
    assert authorize_episode_call(SECRET, header, None, "policy").model == "policy"


def test_episode_call_errors_are_401_or_403(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("time.time", lambda: NOW + 1)
    header = f"Bearer {_token()}"
    with pytest.raises(Forbidden, match="for model 'policy', not 'critic'") as caught:
        authorize_episode_call(SECRET, header, "ep-7", "critic")
    assert (caught.value.status_code, caught.value.code) == (403, "forbidden")
    with pytest.raises(Forbidden, match="episode 'ep-7', not 'ep-8'"):
        authorize_episode_call(SECRET, header, "ep-8", "policy")
    with pytest.raises(Forbidden, match="begin an episode"):
        authorize_episode_call(SECRET, f"Bearer {_run_token()}", None, "policy")
    with pytest.raises(Unauthorized, match="never accepted over HTTP"):
        authorize_episode_call(SECRET, f"Bearer {SECRET}", None, "policy")
    with pytest.raises(Unauthorized, match="missing") as missing:
        authorize_episode_call(SECRET, None, None, "policy")
    assert (missing.value.status_code, missing.value.code) == (401, "invalid_api_key")
    with pytest.raises(Unauthorized, match="episode token"):
        authorize_episode_call(SECRET, "Bearer sk-not-ours", None, "policy")
    monkeypatch.setattr("time.time", lambda: NOW + 61)
    with pytest.raises(Unauthorized, match="expired"):
        authorize_episode_call(SECRET, header, "ep-7", "policy")
    assert issubclass(Unauthorized, AuthError) and issubclass(Forbidden, AuthError)


def test_episode_api_needs_a_run_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("time.time", lambda: NOW + 1)
    authorize_run_call(SECRET, f"Bearer {_run_token()}")
    with pytest.raises(Unauthorized, match="never accepted over HTTP"):
        authorize_run_call(SECRET, f"Bearer {SECRET}")
    with pytest.raises(Forbidden, match="episode token"):
        authorize_run_call(SECRET, f"Bearer {_token()}")
    with pytest.raises(Unauthorized):
        authorize_run_call(SECRET, "Bearer guess")
    with pytest.raises(Unauthorized, match="signature"):
        authorize_run_call(SECRET, f"Bearer {issue_episode_token('0' * 64, 'e', 'policy', 60, now=NOW)}")
    with pytest.raises(Unauthorized, match="missing"):
        authorize_run_call(SECRET, None)


def test_redact_hides_tokens_and_secrets() -> None:
    token = _token()
    line = f"call with {token} by key={SECRET} header='Authorization: Bearer sk-abc' id=ab12 ok"
    redacted = redact(line)
    assert token not in redacted and SECRET not in redacted and "sk-abc" not in redacted
    assert redacted == (
        "call with [redacted] by key=[redacted] header='Authorization: Bearer [redacted]' id=ab12 ok"
    )
    assert redact("episode ep-7 step 3") == "episode ep-7 step 3"


def test_verified_tokens_are_cached_but_expiry_and_key_are_checked_on_every_use() -> None:
    """The cache of verified tokens (one HMAC check per token and process) never admits what a full check
    refuses: an expired token, the same token under another secret, or a run token presented as an episode
    token; a forged token is not cached (checked in full each time)."""
    token = _token(ttl_s=60)
    assert verify_episode_token(SECRET, token, now=NOW).episode_id == "ep-7"
    assert verify_episode_token(SECRET, token, now=NOW + 59).episode_id == "ep-7"  # from the cache
    with pytest.raises(Unauthorized, match="expired"):
        verify_episode_token(SECRET, token, now=NOW + 60)
    with pytest.raises(Unauthorized, match="signature"):
        verify_episode_token("1" * 64, token, now=NOW)
    run = _run_token()
    verify_run_token(SECRET, run, now=NOW + 1)
    verify_run_token(SECRET, run, now=NOW + 2)  # cached
    with pytest.raises(Unauthorized, match="expired"):
        verify_run_token(SECRET, run, now=NOW + RUN_TOKEN_TTL_S)
    with pytest.raises(Unauthorized, match="malformed episode token"):
        verify_episode_token(SECRET, run, now=NOW + 1)
    with pytest.raises(Unauthorized, match="malformed run token"):
        verify_run_token(SECRET, token, now=NOW)
    forged = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    for _ in range(2):
        with pytest.raises(Unauthorized, match="signature"):
            verify_episode_token(SECRET, forged, now=NOW)


def test_the_cache_of_verified_tokens_is_bounded() -> None:
    cache = _Verified(3)
    for index in range(5):
        cache.put(SECRET, f"t{index}", float(index), None)
    assert (
        len(cache.entries) == 3 and cache.get(SECRET, "t0") is None and cache.get(SECRET, "t4") == (4.0, None)
    )
