"""Which configured provider a token belongs to: by its issuer, then (when one issuer serves several) its audience.

The choice is made from claims that are not verified yet, which is safe
because it only decides whose settings and keys the rest of the checks use:
a token routed to a provider is then verified against that provider's keys
alone, so one IdP can never vouch for another's issuer, and the issuer and
audience are checked again (exactly) once the signature holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from inferflux.policy.authn.oidc.config import OidcProviderConfig, normalize_issuer
from inferflux.policy.authn.oidc.parsing import ParsedToken
from inferflux.policy.errors import InvalidToken


class ProviderRoutes:
    """The providers grouped by normalised issuer; ``select`` picks a token's provider.

    Several providers may share an issuer (one IdP serving several tenants'
    applications) if their audiences differ: tokens are routed by both.
    """

    def __init__(self, providers: Iterable[OidcProviderConfig]) -> None:
        by_issuer: dict[str, list[OidcProviderConfig]] = {}
        for provider in providers:
            if not isinstance(provider, OidcProviderConfig):
                raise TypeError(f"expected OidcProviderConfig, got {type(provider).__name__}")
            same_issuer = by_issuer.setdefault(normalize_issuer(provider.issuer), [])
            twin = next((p for p in same_issuer if p.audience == provider.audience), None)
            if twin is not None:
                raise ValueError(
                    f"OIDC providers {twin.id!r} and {provider.id!r} share issuer {provider.issuer!r} "
                    f"and audience {provider.audience!r}"
                )
            same_issuer.append(provider)
        self._by_issuer = by_issuer

    def providers(self) -> Iterator[OidcProviderConfig]:
        for group in self._by_issuer.values():
            yield from group

    def select(self, parsed: ParsedToken) -> OidcProviderConfig:
        issuer = parsed.claims.get("iss")
        if issuer is None:
            raise InvalidToken("the token has no 'iss' claim", code="missing_claim")
        if not isinstance(issuer, str):
            raise InvalidToken("the token's 'iss' claim is not a string", code="invalid_issuer")
        candidates = self._by_issuer.get(normalize_issuer(issuer))
        if not candidates:
            raise InvalidToken("the token's issuer is not a trusted identity provider", code="unknown_issuer")
        if len(candidates) == 1:
            return candidates[0]  # its audience is checked with the other claims
        return self._select_by_audience(parsed, candidates)

    @staticmethod
    def _select_by_audience(parsed: ParsedToken, candidates: list[OidcProviderConfig]) -> OidcProviderConfig:
        """One issuer, several providers: the token's (not yet verified) ``aud`` picks one.

        Safe before the signature: every candidate trusts the same issuer's keys, and the
        audience is checked again after it. A token addressed to two of them is refused,
        not given to either: which tenant it enters must not be the token's choice.
        """
        audience = parsed.claims.get("aud")
        named = [audience] if isinstance(audience, str) else audience if isinstance(audience, list) else []
        audiences = {a for a in named if isinstance(a, str)}
        matching = [p for p in candidates if p.audience in audiences]
        if not matching:
            raise InvalidToken("the token is not meant for this service", code="invalid_audience")
        if len(matching) > 1:
            raise InvalidToken(
                "the token is addressed to several identity providers here; it must name one audience",
                code="ambiguous_audience",
            )
        return matching[0]
