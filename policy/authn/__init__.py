"""Authentication: API keys (``apikeys``) and OIDC bearer JWTs (``oidc``)."""
