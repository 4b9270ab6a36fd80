"""OIDC bearer-JWT verification against a real identity provider on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from idp import (
    DEFAULT_AUDIENCE,
    EC_KID,
    ED_KID,
    RSA_KID,
    FakeClock,
    LoopbackIdP,
    b64url,
    b64url_json,
    closed_loopback_url,
    hand_built_token,
    hmac_token,
)

from inferflux.policy.authn.oidc import ALLOWED_ALGORITHMS, OidcProviderConfig, OidcVerifier, VerifiedToken
from inferflux.policy.errors import IdentityProviderUnavailable, InvalidToken, PolicyError

ROLE_MAP = {"admin": "tenant-admin", "dev": "member", "reader": "viewer"}
TTL = 3600.0
REFRESH_INTERVAL = 30.0
# No test here is about a slow provider; a loaded 2-core CI runner once stalled a loopback connect
# past 5 s (ConnectTimeout in test_issued_in_the_future), so the bound is generous.
HTTP_TIMEOUT = 30.0


def provider_for(idp: LoopbackIdP, **overrides: Any) -> OidcProviderConfig:
    settings: dict[str, Any] = {
        "id": "idp-1",
        "name": "Loopback IdP",
        "issuer": idp.issuer,
        "audience": DEFAULT_AUDIENCE,
        "role_map": ROLE_MAP,
    }
    settings.update(overrides)
    return OidcProviderConfig(**settings)


def make_verifier(providers: list[OidcProviderConfig], clock: FakeClock) -> OidcVerifier:
    return OidcVerifier(
        providers, clock=clock, jwks_ttl=TTL, min_refresh_interval=REFRESH_INTERVAL, http_timeout=HTTP_TIMEOUT
    )


@pytest.fixture
async def verifier(idp: LoopbackIdP, clock: FakeClock) -> AsyncIterator[OidcVerifier]:
    v = make_verifier([provider_for(idp)], clock)
    yield v
    await v.aclose()


async def rejected(verifier: OidcVerifier, token: Any, code: str) -> InvalidToken:
    with pytest.raises(InvalidToken) as info:
        await verifier.verify(token)
    assert info.value.code == code, info.value.message
    assert info.value.status_code == 401
    return info.value


def tamper(segment: str) -> str:
    # A character in the middle: the last one may only carry padding bits.
    i = len(segment) // 2
    return segment[:i] + ("A" if segment[i] != "A" else "B") + segment[i + 1 :]


# -- provider configuration -----------------------------------------------------


@pytest.mark.parametrize("algorithms", [("none",), ("HS256",), ("RS256", "HS256"), ("RS256", "none"), ("HS512",), ()])
def test_config_rejects_symmetric_none_and_empty_algorithms(algorithms: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        OidcProviderConfig(id="p", name="P", issuer="https://idp.example", audience="a", algorithms=algorithms)


def test_allow_list_is_asymmetric_only() -> None:
    assert "none" not in ALLOWED_ALGORITHMS
    assert not any(alg.startswith("HS") for alg in ALLOWED_ALGORITHMS)


@pytest.mark.parametrize(
    "issuer",
    ["http://idp.example", "http://10.0.0.1:8080", "ftp://idp.example", "idp.example", "https://idp.example/?x=1",
     "https://user:pw@idp.example"],
)
def test_config_rejects_insecure_or_odd_issuers(issuer: str) -> None:
    with pytest.raises(ValueError):
        OidcProviderConfig(id="p", name="P", issuer=issuer, audience="a")


@pytest.mark.parametrize(
    "issuer", ["https://idp.example", "https://idp.example/realms/x", "http://127.0.0.1:9000", "http://localhost",
               "http://[::1]:9000"]
)
def test_config_accepts_https_and_loopback_http(issuer: str) -> None:
    assert OidcProviderConfig(id="p", name="P", issuer=issuer, audience="a").issuer == issuer


def test_config_rejects_http_jwks_uri_off_loopback_and_unknown_roles() -> None:
    with pytest.raises(ValueError, match="https"):
        OidcProviderConfig(
            id="p", name="P", issuer="https://idp.example", audience="a", jwks_uri="http://idp.example/k"
        )
    with pytest.raises(ValueError, match="role_map"):
        OidcProviderConfig(id="p", name="P", issuer="https://idp.example", audience="a", role_map={"x": "root"})
    with pytest.raises(ValueError, match="leeway"):
        OidcProviderConfig(id="p", name="P", issuer="https://idp.example", audience="a", leeway_seconds=-1)


def test_config_is_immutable_after_construction() -> None:
    role_map = {"admin": "tenant-admin"}
    config = OidcProviderConfig(
        id="p", name="P", issuer="https://idp.example", audience="a", algorithms=["RS256"], role_map=role_map
    )
    role_map["admin"] = "platform-admin"
    assert config.role_map["admin"] == "tenant-admin"
    assert config.algorithms == ("RS256",)


def test_verifier_rejects_two_providers_for_one_issuer_and_audience() -> None:
    a = OidcProviderConfig(id="a", name="A", issuer="https://idp.example", audience="x")
    b = OidcProviderConfig(id="b", name="B", issuer="https://idp.example/", audience="x")
    with pytest.raises(ValueError, match="share issuer"):
        OidcVerifier([a, b])


async def test_one_issuer_several_audiences_routes_by_audience(idp: LoopbackIdP, clock: FakeClock) -> None:
    # One IdP serving two tenants' applications: each token reaches the provider of its audience.
    acme = provider_for(idp, id="acme-idp", audience="acme-app")
    globex = provider_for(idp, id="globex-idp", audience="globex-app")
    verifier = make_verifier([acme, globex], clock)
    try:
        for audience, provider in (("acme-app", acme), ("globex-app", globex), (["x", "globex-app"], globex)):
            token = idp.mint(idp.claims(clock.now, audience=audience), kid=RSA_KID)
            verified = await verifier.verify(token)
            assert verified.provider_id == provider.id and verified.bounds == provider.bounds
        await rejected(verifier, idp.mint(idp.claims(clock.now, audience="other"), kid=RSA_KID), "invalid_audience")
        await rejected(verifier, idp.mint(idp.claims(clock.now, audience=[{"x": 1}]), kid=RSA_KID), "invalid_audience")
        # Addressed to both: which tenant it enters must not be the token's choice.
        both = idp.mint(idp.claims(clock.now, audience=["acme-app", "globex-app"]), kid=RSA_KID)
        await rejected(verifier, both, "ambiguous_audience")
    finally:
        await verifier.aclose()


# -- valid tokens ------------------------------------------------------------------


@pytest.mark.parametrize(("kid", "alg"), [(RSA_KID, "RS256"), (EC_KID, "ES256"), (ED_KID, "EdDSA")])
async def test_valid_token_for_each_key_type(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock, kid: str, alg: str
) -> None:
    claims = idp.claims(clock.now, sub="alice", roles=["admin"], groups=["ml", "ops"])
    result = await verifier.verify(idp.mint(claims, kid=kid, alg=alg))
    assert isinstance(result, VerifiedToken)
    assert result.provider_id == "idp-1"
    assert result.issuer == idp.issuer
    assert result.subject == "alice"
    assert result.tenant == "acme"
    assert result.roles == ("tenant-admin",)
    assert result.groups == ("ml", "ops")
    assert result.expires_at == float(claims["exp"])
    assert result.claims["sub"] == "alice"
    assert idp.discovery_fetches == 1 and idp.jwks_fetches == 1


async def test_keys_are_cached_between_tokens(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    for kid in (RSA_KID, EC_KID, ED_KID, RSA_KID):
        await verifier.verify(idp.mint(idp.claims(clock.now), kid=kid))
    assert idp.discovery_fetches == 1 and idp.jwks_fetches == 1


async def test_token_without_kid_uses_the_only_fitting_key(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    result = await verifier.verify(idp.mint(idp.claims(clock.now), kid=EC_KID, include_kid=False))
    assert result.subject == "user-1"


async def test_token_without_kid_and_several_fitting_keys_is_refused(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    idp.add_key("EC", kid="ec-extra")
    await rejected(verifier, idp.mint(idp.claims(clock.now), kid=EC_KID, include_kid=False), "unknown_key")


# -- time claims ---------------------------------------------------------------------


async def test_expired_token(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    claims = idp.claims(clock.now - 400, exp=int(clock.now) - 100)
    await rejected(verifier, idp.mint(claims, kid=RSA_KID), "token_expired")


async def test_leeway_accepts_token_expired_moments_ago(
    idp: LoopbackIdP, clock: FakeClock, verifier: OidcVerifier
) -> None:
    token = idp.mint(idp.claims(clock.now - 300, exp=int(clock.now) - 10), kid=RSA_KID)
    assert (await verifier.verify(token)).subject == "user-1"  # 30 s leeway by default
    strict = make_verifier([provider_for(idp, leeway_seconds=0)], clock)
    try:
        await rejected(strict, token, "token_expired")
    finally:
        await strict.aclose()


async def test_time_claim_boundaries(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    # "exp" is the moment on or after which a token is refused (RFC 7519 4.1.4), "nbf" and "iat"
    # may be at most the leeway (30 s) ahead; joserfc's registry reads "exp" so from 1.8 on.
    clock.now = 1_700_000_000.0
    now = 1_700_000_000
    await rejected(verifier, idp.mint(idp.claims(now - 300, exp=now - 30), kid=RSA_KID), "token_expired")
    await verifier.verify(idp.mint(idp.claims(now - 300, exp=now - 29), kid=RSA_KID))
    await verifier.verify(idp.mint(idp.claims(now, nbf=now + 30, iat=now + 30), kid=RSA_KID))
    await rejected(verifier, idp.mint(idp.claims(now, nbf=now + 31), kid=RSA_KID), "token_not_yet_valid")
    await rejected(verifier, idp.mint(idp.claims(now, iat=now + 31), kid=RSA_KID), "token_issued_in_future")


async def test_expiry_follows_the_clock(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    token = idp.mint(idp.claims(clock.now), kid=RSA_KID)  # exp = now + 300
    await verifier.verify(token)
    clock.advance(300 + 30 + 1)
    await rejected(verifier, token, "token_expired")


async def test_not_yet_valid(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    token = idp.mint(idp.claims(clock.now, nbf=int(clock.now) + 120), kid=RSA_KID)
    await rejected(verifier, token, "token_not_yet_valid")
    # Within the leeway a slightly fast IdP clock is tolerated.
    await verifier.verify(idp.mint(idp.claims(clock.now, nbf=int(clock.now) + 10), kid=RSA_KID))


async def test_issued_in_the_future(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    claims = idp.claims(clock.now, iat=int(clock.now) + 120, exp=int(clock.now) + 600)
    await rejected(verifier, idp.mint(claims, kid=RSA_KID), "token_issued_in_future")


async def test_non_numeric_time_claim(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    await rejected(verifier, idp.mint(idp.claims(clock.now, exp="tomorrow"), kid=RSA_KID), "invalid_claim")
    await rejected(verifier, idp.mint(idp.claims(clock.now, nbf=True), kid=RSA_KID), "invalid_claim")


@pytest.mark.parametrize("claim", ["exp", "nbf", "iat"])
async def test_time_claim_too_large_for_a_float_is_refused(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock, claim: str
) -> None:
    # A JSON integer of 400 digits is a number, but no time: refused, not an OverflowError (a 500).
    await rejected(verifier, idp.mint(idp.claims(clock.now, **{claim: 10**400}), kid=RSA_KID), "invalid_claim")


async def test_claims_are_judged_in_a_fixed_order(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    # Whatever order the IdP writes them in: issuer, audience, subject, exp, nbf, iat.
    late = int(clock.now) + 120
    await rejected(verifier, idp.mint({**idp.claims(clock.now, iat=late, nbf=late, sub=""), "aud": "x"},
                                      kid=RSA_KID), "invalid_audience")
    await rejected(verifier, idp.mint(idp.claims(clock.now, iat=late, nbf=late, exp="x"), kid=RSA_KID), "invalid_claim")
    await rejected(verifier, idp.mint(idp.claims(clock.now, iat=late, nbf=late), kid=RSA_KID), "token_not_yet_valid")
    # Registered claims this service does not use are not judged.
    assert (await verifier.verify(idp.mint(idp.claims(clock.now, jti=5), kid=RSA_KID))).subject == "user-1"


# -- issuer and audience ------------------------------------------------------------


async def test_unknown_issuer_is_refused_without_contacting_anyone(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    token = idp.mint(idp.claims(clock.now, iss="https://evil.example"), kid=RSA_KID)
    await rejected(verifier, token, "unknown_issuer")
    assert idp.discovery_fetches == 0 and idp.jwks_fetches == 0


async def test_known_provider_but_issuer_not_exact(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    # Routed to our provider (trailing slash), but the issuer must match exactly.
    await rejected(verifier, idp.mint(idp.claims(clock.now, iss=idp.issuer + "/"), kid=RSA_KID), "invalid_issuer")


async def test_token_of_one_provider_cannot_use_another_providers_keys(
    idp: LoopbackIdP, clock: FakeClock
) -> None:
    # Provider B trusts a different (down) key source; a token claiming B's issuer but
    # signed by A's key must never be checked against A's keys.
    other = OidcProviderConfig(id="b", name="B", issuer="https://other.example", audience=DEFAULT_AUDIENCE,
                               jwks_uri=closed_loopback_url() + "/jwks.json")
    verifier = make_verifier([provider_for(idp), other], clock)
    try:
        token = idp.mint(idp.claims(clock.now, iss="https://other.example"), kid=RSA_KID)
        with pytest.raises(IdentityProviderUnavailable):
            await verifier.verify(token)
        assert idp.jwks_fetches == 0
    finally:
        await verifier.aclose()


async def test_wrong_audience(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    await rejected(verifier, idp.mint(idp.claims(clock.now, audience="someone-else"), kid=RSA_KID), "invalid_audience")
    await rejected(verifier, idp.mint(idp.claims(clock.now, audience=["a", "b"]), kid=RSA_KID), "invalid_audience")
    await rejected(verifier, idp.mint(idp.claims(clock.now, audience=42), kid=RSA_KID), "invalid_audience")


async def test_audience_list_containing_ours(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    token = idp.mint(idp.claims(clock.now, audience=["account", DEFAULT_AUDIENCE]), kid=ED_KID)
    assert (await verifier.verify(token)).tenant == "acme"


# -- required claims, tenant, roles, groups ---------------------------------------------


@pytest.mark.parametrize("claim", ["sub", "exp", "iat", "aud", "iss"])
async def test_missing_required_claim(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock, claim: str) -> None:
    claims = idp.claims(clock.now)
    del claims[claim]
    await rejected(verifier, idp.mint(claims, kid=RSA_KID), "missing_claim")


async def test_provider_required_claims(idp: LoopbackIdP, clock: FakeClock) -> None:
    verifier = make_verifier([provider_for(idp, required_claims=("email", "org.id"))], clock)
    try:
        await rejected(verifier, idp.mint(idp.claims(clock.now, email="a@x"), kid=RSA_KID), "missing_claim")
        await verifier.verify(idp.mint(idp.claims(clock.now, email="a@x", org={"id": "o1"}), kid=RSA_KID))
    finally:
        await verifier.aclose()


async def test_missing_tenant_claim(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    await rejected(verifier, idp.mint(idp.claims(clock.now, tenant=None), kid=RSA_KID), "missing_tenant_claim")
    await rejected(verifier, idp.mint(idp.claims(clock.now, tenant=""), kid=RSA_KID), "missing_tenant_claim")
    await rejected(verifier, idp.mint(idp.claims(clock.now, tenant=["a", "b"]), kid=RSA_KID), "invalid_tenant_claim")


async def test_roles_are_mapped_and_unmapped_values_ignored(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    as_list = idp.claims(clock.now, roles=["admin", "superuser", "dev", "admin", 7])
    assert (await verifier.verify(idp.mint(as_list, kid=RSA_KID))).roles == ("tenant-admin", "member")
    as_string = idp.claims(clock.now, roles="reader  platform-admin dev")
    # "platform-admin" is not a key of role_map: an IdP cannot name our roles directly.
    assert (await verifier.verify(idp.mint(as_string, kid=RSA_KID))).roles == ("viewer", "member")
    assert (await verifier.verify(idp.mint(idp.claims(clock.now), kid=RSA_KID))).roles == ()
    assert (await verifier.verify(idp.mint(idp.claims(clock.now, roles={"x": 1}), kid=RSA_KID))).roles == ()


async def test_nested_claim_paths(idp: LoopbackIdP, clock: FakeClock) -> None:
    provider = provider_for(
        idp, tenant_claim="org.tenant", roles_claim="realm_access.roles", groups_claim="org.teams",
        role_map={"ifx-admin": "platform-admin", "ifx-user": "member"},
    )
    verifier = make_verifier([provider], clock)
    try:
        claims = idp.claims(
            clock.now, tenant=None,
            org={"tenant": "globex", "teams": "red blue red"},
            realm_access={"roles": ["offline_access", "ifx-user", "ifx-admin"]},
        )
        result = await verifier.verify(idp.mint(claims, kid=EC_KID))
        assert (result.tenant, result.roles, result.groups) == ("globex", ("member", "platform-admin"), ("red", "blue"))
        # A flat "tenant" claim does not stand in for the configured nested one.
        await rejected(verifier, idp.mint(idp.claims(clock.now), kid=EC_KID), "missing_tenant_claim")
    finally:
        await verifier.aclose()


async def test_namespaced_claim_names_containing_dots(idp: LoopbackIdP, clock: FakeClock) -> None:
    provider = provider_for(idp, tenant_claim="https://inferflux.example/tenant", groups_claim=None)
    verifier = make_verifier([provider], clock)
    try:
        claims = idp.claims(clock.now, tenant=None, groups=["g"], **{"https://inferflux.example/tenant": "initech"})
        result = await verifier.verify(idp.mint(claims, kid=RSA_KID))
        assert result.tenant == "initech" and result.groups == ()
    finally:
        await verifier.aclose()


# -- signatures and algorithms ----------------------------------------------------------


async def test_tampered_signature(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    for kid in (RSA_KID, EC_KID, ED_KID):
        header, payload, signature = idp.mint(idp.claims(clock.now), kid=kid).split(".")
        await rejected(verifier, f"{header}.{payload}.{tamper(signature)}", "invalid_signature")
        await rejected(verifier, f"{header}.{payload}.", "invalid_signature")


async def test_tampered_payload(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    header, _, signature = idp.mint(idp.claims(clock.now), kid=RSA_KID).split(".")
    forged = b64url_json(idp.claims(clock.now, tenant="victim", roles=["admin"]))
    await rejected(verifier, f"{header}.{forged}.{signature}", "invalid_signature")


async def test_signature_by_an_unpublished_key_with_a_published_kid(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    rogue = idp.add_key("RSA", publish=False)
    token = idp.mint(idp.claims(clock.now), kid=rogue, header={"kid": RSA_KID})
    await rejected(verifier, token, "invalid_signature")


@pytest.mark.parametrize("alg", ["none", "None", "NONE", "nOnE"])
async def test_alg_none(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock, alg: str) -> None:
    token = hand_built_token({"alg": alg, "typ": "JWT", "kid": RSA_KID}, idp.claims(clock.now))
    await rejected(verifier, token, "unsupported_algorithm")
    assert idp.jwks_fetches == 0  # refused before any key lookup


async def test_hs256_signed_with_the_rsa_public_key_is_refused(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    # The classic confusion attack: a verifier that lets the token pick HS256 would
    # use the RSA public key (which anyone can fetch) as the HMAC secret.
    claims = idp.claims(clock.now, roles=["admin"])
    for secret in (idp.public_pem(RSA_KID), json.dumps(idp.jwks()["keys"][0]).encode()):
        token = hmac_token({"alg": "HS256", "typ": "JWT", "kid": RSA_KID}, claims, secret)
        await rejected(verifier, token, "unsupported_algorithm")
    assert idp.jwks_fetches == 0


async def test_symmetric_and_none_are_refused_before_the_issuer_is_considered(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    claims = idp.claims(clock.now, iss="https://evil.example")
    await rejected(verifier, hmac_token({"alg": "HS256"}, claims, b"k"), "unsupported_algorithm")
    await rejected(verifier, hand_built_token({"alg": "none"}, claims), "unsupported_algorithm")


async def test_algorithm_outside_the_providers_list(idp: LoopbackIdP, clock: FakeClock) -> None:
    verifier = make_verifier([provider_for(idp, algorithms=("RS256",))], clock)
    try:
        await rejected(verifier, idp.mint(idp.claims(clock.now), kid=EC_KID), "unsupported_algorithm")
        await rejected(verifier, idp.mint(idp.claims(clock.now), kid=RSA_KID, alg="PS256"), "unsupported_algorithm")
        assert idp.jwks_fetches == 0
        await verifier.verify(idp.mint(idp.claims(clock.now), kid=RSA_KID))
    finally:
        await verifier.aclose()


async def test_key_type_must_match_algorithm(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    # An ES256 token pointing at the RSA key's kid: the RSA key must not be tried.
    token = idp.mint(idp.claims(clock.now), kid=EC_KID, header={"kid": RSA_KID})
    await rejected(verifier, token, "key_type_mismatch")
    token = idp.mint(idp.claims(clock.now), kid=RSA_KID, header={"kid": ED_KID})
    await rejected(verifier, token, "key_type_mismatch")


async def test_jwks_junk_entries_are_skipped(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    good = idp.key(RSA_KID).as_dict(private=False, use="sig")
    idp.raw_jwks = json.dumps(
        {
            "keys": [
                {"kty": "oct", "kid": "hmac", "k": b64url(b"shared-secret")},
                {**idp.key(EC_KID).as_dict(private=False), "use": "enc"},
                {"kty": "RSA", "kid": "broken", "n": "!!", "e": "AQAB"},
                "not-a-key",
                good,
            ]
        }
    ).encode()
    await verifier.verify(idp.mint(idp.claims(clock.now), kid=RSA_KID))
    await rejected(verifier, idp.mint(idp.claims(clock.now), kid=EC_KID), "unknown_key")
    await rejected(verifier, hmac_token({"alg": "HS256", "kid": "hmac"}, idp.claims(clock.now), b"shared-secret"),
                   "unsupported_algorithm")


# -- key rotation and the refresh rate limit -----------------------------------------


async def test_key_rotation_is_picked_up_with_one_refresh(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    await verifier.verify(idp.mint(idp.claims(clock.now), kid=RSA_KID))
    assert idp.jwks_fetches == 1
    clock.advance(REFRESH_INTERVAL + 1)
    new_kid = idp.rotate(RSA_KID)
    result = await verifier.verify(idp.mint(idp.claims(clock.now), kid=new_kid))
    assert result.subject == "user-1"
    assert idp.jwks_fetches == 2
    # The withdrawn key is gone from the cache too; asking again is rate-limited.
    await rejected(verifier, idp.mint(idp.claims(clock.now), kid=RSA_KID), "unknown_key")
    assert idp.jwks_fetches == 2


async def test_rotation_right_after_a_fetch_waits_for_the_refresh_interval(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    await verifier.verify(idp.mint(idp.claims(clock.now), kid=EC_KID))
    new_kid = idp.rotate(EC_KID)
    token = idp.mint(idp.claims(clock.now), kid=new_kid)
    await rejected(verifier, token, "unknown_key")
    assert idp.jwks_fetches == 1
    clock.advance(REFRESH_INTERVAL)
    await verifier.verify(token)
    assert idp.jwks_fetches == 2


async def test_unknown_kid_burst_costs_at_most_one_fetch(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    await verifier.verify(idp.mint(idp.claims(clock.now), kid=RSA_KID))
    clock.advance(REFRESH_INTERVAL + 1)
    claims = idp.claims(clock.now)
    tokens = [idp.mint(claims, kid=RSA_KID, header={"kid": f"made-up-{i}"}) for i in range(40)]
    results = await asyncio.gather(*(verifier.verify(t) for t in tokens[:20]), return_exceptions=True)
    assert all(isinstance(r, InvalidToken) and r.code == "unknown_key" for r in results), results
    for token in tokens[20:]:
        await rejected(verifier, token, "unknown_key")
    assert idp.jwks_fetches == 2  # the warm-up fetch and exactly one refresh


async def test_cold_start_burst_shares_one_fetch(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    tokens = [idp.mint(idp.claims(clock.now, sub=f"u{i}"), kid=(RSA_KID, EC_KID, ED_KID)[i % 3]) for i in range(20)]
    results = await asyncio.gather(*(verifier.verify(t) for t in tokens))
    assert [r.subject for r in results] == [f"u{i}" for i in range(20)]
    assert idp.discovery_fetches == 1 and idp.jwks_fetches == 1


async def test_jwks_is_refreshed_after_its_ttl(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    await verifier.verify(idp.mint(idp.claims(clock.now), kid=RSA_KID))
    clock.advance(TTL + 1)
    await verifier.verify(idp.mint(idp.claims(clock.now), kid=RSA_KID))
    assert idp.jwks_fetches == 2


async def test_set_providers_keeps_keys_of_unchanged_issuers(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    await verifier.verify(idp.mint(idp.claims(clock.now), kid=RSA_KID))
    verifier.set_providers([provider_for(idp, audience="new-audience", id="idp-1b")])
    result = await verifier.verify(idp.mint(idp.claims(clock.now, audience="new-audience"), kid=RSA_KID))
    assert result.provider_id == "idp-1b"
    await rejected(verifier, idp.mint(idp.claims(clock.now), kid=RSA_KID), "invalid_audience")
    assert idp.jwks_fetches == 1
    verifier.set_providers([])
    await rejected(verifier, idp.mint(idp.claims(clock.now), kid=RSA_KID), "unknown_issuer")


async def test_configured_jwks_uri_skips_discovery(idp: LoopbackIdP, clock: FakeClock) -> None:
    verifier = make_verifier([provider_for(idp, jwks_uri=f"{idp.issuer}/jwks.json")], clock)
    try:
        await verifier.verify(idp.mint(idp.claims(clock.now), kid=ED_KID))
        assert idp.discovery_fetches == 0 and idp.jwks_fetches == 1
    finally:
        await verifier.aclose()


# -- identity provider failures ---------------------------------------------------------


async def unavailable(verifier: OidcVerifier, token: str, code: str = "identity_provider_unavailable") -> None:
    with pytest.raises(IdentityProviderUnavailable) as info:
        await verifier.verify(token)
    assert info.value.status_code == 503
    assert info.value.code == code, info.value.message


async def test_idp_unreachable_is_503(idp: LoopbackIdP, clock: FakeClock) -> None:
    down = closed_loopback_url()
    verifier = make_verifier([provider_for(idp, issuer=down)], clock)
    try:
        await unavailable(verifier, idp.mint(idp.claims(clock.now, iss=down), kid=RSA_KID))
    finally:
        await verifier.aclose()


@pytest.mark.parametrize("status", [500, 503, 404])
async def test_idp_error_status_is_503(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock, status: int) -> None:
    idp.fail_with = status
    await unavailable(verifier, idp.mint(idp.claims(clock.now), kid=RSA_KID))


async def test_idp_failure_is_not_retried_on_every_request(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    idp.fail_with = 503
    token = idp.mint(idp.claims(clock.now), kid=RSA_KID)
    await unavailable(verifier, token)
    for _ in range(5):
        await unavailable(verifier, token)
    assert idp.discovery_fetches == 1
    idp.fail_with = None
    clock.advance(REFRESH_INTERVAL)
    await verifier.verify(token)
    assert idp.discovery_fetches == 2 and idp.jwks_fetches == 1


async def test_discovery_issuer_mismatch_is_refused(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    idp.discovery_overrides = {"issuer": "https://evil.example"}
    await unavailable(verifier, idp.mint(idp.claims(clock.now), kid=RSA_KID), code="issuer_mismatch")
    assert idp.jwks_fetches == 0


async def test_discovery_with_insecure_jwks_uri_is_refused(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    idp.discovery_overrides = {"jwks_uri": "http://keys.example/jwks.json"}
    await unavailable(verifier, idp.mint(idp.claims(clock.now), kid=RSA_KID), code="invalid_discovery_document")


@pytest.mark.parametrize("body", [b"not json", b"[]", b'{"keys": "nope"}'])
async def test_broken_jwks_is_503(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock, body: bytes) -> None:
    idp.raw_jwks = body
    await unavailable(verifier, idp.mint(idp.claims(clock.now), kid=RSA_KID), code="invalid_jwks")


async def test_redirects_are_not_followed(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    # Whoever controls a redirect would choose the keys we trust.
    idp.discovery_overrides = {"jwks_uri": f"{idp.issuer}/moved"}
    await unavailable(verifier, idp.mint(idp.claims(clock.now), kid=RSA_KID))
    assert idp.jwks_fetches == 0


async def test_cached_keys_outlive_an_idp_outage(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    await verifier.verify(idp.mint(idp.claims(clock.now), kid=RSA_KID))
    clock.advance(TTL + 1)
    idp.fail_with = 503
    assert (await verifier.verify(idp.mint(idp.claims(clock.now), kid=RSA_KID))).subject == "user-1"
    assert idp.discovery_fetches == 2  # the refresh was attempted, failed, and the stale keys served


# -- malformed input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "token",
    [
        "garbage",
        "",
        "a.b",
        "a.b.c.d",
        "a.b.c.d.e",
        "...",
        "!!!.???.***",
        b64url(b"not json") + "." + b64url(b"{}") + ".sig",
        b64url_json([1, 2]) + "." + b64url_json({}) + ".sig",
        b64url_json({"typ": "JWT"}) + "." + b64url_json({}) + ".sig",
        b64url_json({"alg": 256}) + "." + b64url_json({}) + ".sig",
        b64url_json({"alg": "RS256", "kid": 7}) + "." + b64url_json({}) + ".sig",
        b64url_json({"alg": "RS256"}) + "." + b64url(b'{"a": NaN}') + ".sig",
        b64url_json({"alg": "RS256"}) + "." + b64url(b'{"sub": "a", "sub": "b"}') + ".sig",
        b64url_json({"alg": "RS256"}) + "." + b64url(b"\xff\xfe") + ".sig",
        b64url_json({"alg": "RS256"}) + "=." + b64url_json({}) + ".sig",
        "é.é.é",
    ],
)
async def test_malformed_tokens(verifier: OidcVerifier, token: str) -> None:
    await rejected(verifier, token, "malformed_token")


async def test_malformed_non_text_and_huge_tokens(idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock) -> None:
    await rejected(verifier, None, "malformed_token")
    await rejected(verifier, b"a.b.c", "malformed_token")
    huge = idp.mint(idp.claims(clock.now, padding="x" * 20_000), kid=RSA_KID)
    await rejected(verifier, huge, "malformed_token")
    assert idp.jwks_fetches == 0


async def test_no_mutation_of_a_valid_token_escapes_as_anything_but_a_policy_error(
    idp: LoopbackIdP, verifier: OidcVerifier, clock: FakeClock
) -> None:
    token = idp.mint(idp.claims(clock.now), kid=EC_KID)
    await verifier.verify(token)
    accepted = 0
    for i in range(len(token)):
        for replacement in (".", "A", "_", "="):
            mutated = token[:i] + replacement + token[i + 1 :]
            if mutated == token:
                continue
            try:
                await verifier.verify(mutated)
                accepted += 1  # only possible where a character carries unused padding bits
            except InvalidToken:
                pass
            except PolicyError as exc:  # pragma: no cover - the message says what went wrong
                pytest.fail(f"unexpected {type(exc).__name__} for mutation at {i}: {exc.message}")
    assert accepted <= 8
