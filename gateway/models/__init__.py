"""The models this replica serves, and how it follows the store's registry of them.

- ``served``: ``ServedModel`` (what a route dispatches to: its engine, tokenizer, names)
  and ``ModelManager`` (the served models by name and alias), and loading one
- ``admin``: ``ModelAdmin``, loading and unloading models through the admin API, and
  converging with the registry (the store's ``served_models`` records)
- ``loads``: a load asked of the admin API, checked (``checked_load``), and its progress
  while it runs (``ModelLoad``)
- ``sync``: the poll that has every replica follow the registry
- ``manifests``: ``ManifestWatcher``, the model manifests of ``registry.path``: polled, loaded,
  swapped in, drained, reported; ``manifest_files``: which files count, read and parsed
- ``upstreams``: an upstream model's section checked, and its key found
"""
