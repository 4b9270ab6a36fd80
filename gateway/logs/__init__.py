"""The gateway's logs: ``redaction`` keeps credentials off every log line, ``structured`` writes
one JSON object a line (``log_format: json``) with the request's ids."""
