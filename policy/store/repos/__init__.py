"""The policy store's repositories, one module per record type, over shared session helpers.

``base`` (transactions, lookups, the 503 mapping) and ``mapper`` (rows to
records) serve every module; each other module holds one repository class and
the rules of its records. ``PolicyStore`` (``policy.store.repository``) inherits
them all: import it, not these, from outside the store.
"""
