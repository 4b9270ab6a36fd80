"""Money without floats: prices and costs in integer micro-dollars.

A price is micro-dollars per million tokens (``$0.15`` per 1M is 150 000); a
request's cost is ``ceil((prompt * prompt_price + completion * completion_price) / 10**6)``
micro-dollars: rounded up once per request, so a million one-token requests
are not free, and the limiter's spend counter and the usage rollup, which use
this same function, agree to the micro-dollar.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from inferflux.policy.errors import ValidationFailed

MICROS: Final = 1_000_000
MAX_MICROS: Final = 10**12  # a million dollars: limits stay exact in Redis' Lua doubles


@dataclass(frozen=True, slots=True)
class Price:
    """Micro-dollars per million prompt and completion tokens."""

    prompt: int
    completion: int

    def cost(self, prompt_tokens: int, completion_tokens: int) -> int:
        return cost_micros(prompt_tokens, completion_tokens, self)


def cost_micros(prompt_tokens: int, completion_tokens: int, price: Price | None) -> int:
    """What the tokens cost in micro-dollars (0 for a model with no price)."""
    if price is None:
        return 0
    total = prompt_tokens * price.prompt + completion_tokens * price.completion
    return -(-total // MICROS)


def parse_usd(value: Any, param: str, *, allow_zero: bool = True) -> int:
    """Dollars (a decimal string such as ``"2.50"``, or an integer) as micro-dollars; 400 naming ``param``.

    A JSON float is refused: 0.1 is not a tenth in binary, and money must be exact.
    """
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValidationFailed(f"{param} must be dollars as a decimal string (e.g. \"2.50\") or an integer", param=param)
    try:
        amount = Decimal(value.strip() if isinstance(value, str) else value)
    except (InvalidOperation, ValueError):
        raise ValidationFailed(f"{param} must be a decimal number of dollars, e.g. \"2.50\"", param=param) from None
    if not amount.is_finite() or amount.as_tuple().exponent < -6:  # type: ignore[operator]
        raise ValidationFailed(f"{param} must be finite, with at most 6 decimal places", param=param)
    micros = int(amount * MICROS)
    low = 0 if allow_zero else 1
    if not low <= micros <= MAX_MICROS:
        raise ValidationFailed(
            f"{param} must be from {format_usd(low)} to {format_usd(MAX_MICROS)} dollars", param=param
        )
    return micros


def format_usd(micros: int) -> str:
    """Micro-dollars as an exact decimal string of dollars (``"0.000150"``)."""
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), MICROS)
    return f"{sign}{whole}.{frac:06d}"
