"""Bearer-JWT verification against OpenID Connect identity providers.

An ``OidcVerifier`` serves any number of providers. A token is routed to its
provider by its (not yet verified) ``iss`` claim, and by its ``aud`` where one
issuer serves several providers; from then on only that provider's settings
and keys are used, so one IdP can never vouch for another's issuer.

The order of the checks is deliberate, and each step has its module:

1. size and shape (three base64url parts, JSON objects) - cheap, and before any
   allocation proportional to the attacker's input (``parsing``);
2. ``alg`` against the global and the provider's allow-list - *before* any key
   is looked up, so ``none``, ``HS*`` and whatever else a library might accept
   never reach key material (``signing``; the provider is chosen between the
   two lists by ``routing``);
3. the key by ``kid`` from the provider's JWKS, whose type must match the
   algorithm family (fetched and cached by ``discovery``, chosen by ``signing``);
4. the signature (joserfc, given exactly one algorithm: ``signing``);
5. the claims - only after the signature, so an unsigned payload cannot steer
   which error a caller sees (``claims``: joserfc's claims registry for the
   registered claims, with stricter parsing around it, then tenant, roles and
   groups).

``verifier`` strings them together; ``config`` holds what a provider may be
configured with. Every failure is an ``InvalidToken`` (401) whose ``code``
names the rule; a provider that cannot be reached is an
``IdentityProviderUnavailable`` (503).
"""

from inferflux.policy.authn.oidc.claims import ALWAYS_REQUIRED_CLAIMS
from inferflux.policy.authn.oidc.config import (
    ALLOWED_ALGORITHMS,
    DEFAULT_ALGORITHMS,
    MAX_LEEWAY_SECONDS,
    ROLES,
    OidcProviderConfig,
)
from inferflux.policy.authn.oidc.discovery import MAX_DOCUMENT_BYTES, MAX_JWKS_KEYS
from inferflux.policy.authn.oidc.parsing import MAX_TOKEN_LENGTH
from inferflux.policy.authn.oidc.signing import MIN_RSA_KEY_BITS
from inferflux.policy.authn.oidc.verifier import OidcVerifier, VerifiedToken

__all__ = [
    "ALLOWED_ALGORITHMS",
    "ALWAYS_REQUIRED_CLAIMS",
    "DEFAULT_ALGORITHMS",
    "MAX_DOCUMENT_BYTES",
    "MAX_JWKS_KEYS",
    "MAX_LEEWAY_SECONDS",
    "MAX_TOKEN_LENGTH",
    "MIN_RSA_KEY_BITS",
    "ROLES",
    "OidcProviderConfig",
    "OidcVerifier",
    "VerifiedToken",
]
