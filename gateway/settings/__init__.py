"""Server settings: defaults < YAML file < environment < command-line flags.

YAML file (``--config`` or ``INFERFLUX_CONFIG``), every key optional::

    host: 127.0.0.1
    port: 8080
    data_dir: ~/.local/share/inferflux
    log_level: info
    log_format: text        # text | json: one JSON object a line (request id, trace id, tenant; never a secret)
    tracing:                # OpenTelemetry (gateway.tracing); OTEL_* variables configure exporter, endpoint, sampler
      enabled: false
    backend: auto           # default for models that name none: auto (the priority chain) or a backend name
    runtime:
      backend_priority: [cuda, metal, cpu, mlx]   # the chain 'auto' walks (default: backends.registry.default_priority)
      cpu_isa: auto         # the CPU kernels' level: auto (this CPU's own) | avx512 | avx2 | generic
    dtype: auto             # default for models that name none: auto | float32 | bfloat16
    max_body_bytes: 4MiB
    max_queued_sequences: 256   # per model; beyond it requests get 503 + Retry-After
    max_queued_sequences_per_tenant: 128   # per model and tenant; beyond it 429 tenant_queue_full
    input_limits:           # gateway.pipeline.body, gateway.slowclients; breaches are 400s naming the field
      json_max_depth: 32    # nesting of arrays and objects
      json_max_integer_digits: 64
      json_max_string_length: 1048576   # characters, each string
      json_max_array_length: 131072
      json_max_object_keys: 1000
      stop_max_sequences: 16
      stop_max_bytes: 512   # each stop sequence, in UTF-8
      schema_max_bytes: 65536   # each schema (response_format's, a tool's parameters), compact JSON; before the guardrails
      schema_max_total_bytes: 524288   # a request's schemas together
      schema_max_keywords: 10000   # object keys in a request's schemas together
      schema_max_depth: 24  # nesting inside one schema
      schema_max_enum_values: 2000   # enum values in a request's schemas together (and guided_choice's choices)
      schema_max_patterns: 128   # pattern and patternProperties regexes in a request's schemas together
      schema_max_pattern_bytes: 4096   # each of those regexes, and guided_regex
      schema_max_bound: 100000   # each minLength, maxLength, minItems, maxItems, minProperties, ...
      header_timeout_seconds: 10   # a connection's request headers must arrive within this
      body_timeout_seconds: 30     # and its body within this after them (else 408, closed)
      keep_alive_timeout_seconds: 5   # an idle keep-alive connection is closed after this
    grammar:                # a request's new grammars, built in worker processes first (backends.engine.grammar_sandbox)
      workers: 2            # at once
      cpu_seconds: 1        # the request's new grammars together: compile and first mask (over: 400 schema_too_complex)
      wall_seconds: 5       # the same in wall time
      memory_bytes: 512MiB  # each grammar, above the worker's baseline
      queue_seconds: 30     # the longest wait for a free worker (then 503 grammar_busy); tenants take turns
    engine:                 # backends.engine.EngineConfig; omitted keys keep its defaults
      kv_cache_bytes: 512MiB
      block_size: 16        # tokens per KV block; default: the backend's (cpu 8, cuda, metal and mlx 16)
      max_num_seqs: 64
      max_num_batched_tokens: 512
      max_model_len: 8192   # may only lower the model's context length
      grammar_cache_bytes: 256MiB   # compiled grammars kept per model, by estimated size (and at most 256)
      preemption_mode: swap # recompute (default) | swap: park preempted KV instead of dropping it
      swap_space_bytes: 4GiB  # default: the KV cache's size
      swap_dir: /var/lib/inferflux/swap   # unset: swap to host memory
      passes:               # cpu backend load passes (docs/backends.md); each model's own passes override
        quantise: auto      # auto (blocks below AVX-512, exact on it, dense for float files) | blocks | native | hybrid | exact | int8 | int4 | bf16 | f32
        gemm_from: 16       # batch rows from which quantised projections dequantise per tile into a GEMM
        pack: true          # bfloat16 dense weights packed once for oneDNN (same bits, faster; a copy beside each)
        decode_loop: true   # decode steps run every layer in one C++ call (same bits, less overhead a step)
      deterministic: false  # batch-invariant kernels (cpu backend): logits the same bits alone or batched; each model may override
    models:
      - name: smollm2-135m-instruct
        path: /path/to/model.gguf
        backend: cpu        # optional
        dtype: float32      # optional
        aliases: [smollm2]
        passes: {quantise: native}   # optional: over engine.passes
        deterministic: true # optional: over engine.deterministic
        embedding:          # optional: how /v1/embeddings answers for this model (local models only)
          pooling: mean     # mean of the final hidden states (after the final norm) | last: the last token's
          normalize: true   # unit L2 norm, as OpenAI's embeddings have
          matryoshka: false # true: a request's dimensions may shorten the vectors (models trained for it)
          token_ids: false  # true: token-id inputs are taken, as this model's own ids (clients' are often OpenAI's)
      - name: llama-70b     # served by remote OpenAI-compatible servers (backend openai; no path)
        upstream:
          endpoints: [http://10.0.0.5:8000/v1, http://10.0.0.6:8000/v1]
          model: meta-llama/Llama-3.3-70B-Instruct   # the upstream's own name; default: name
          credential: vllm-fleet   # a stored credential (admin API), or api_key_env: INFERFLUX_UPSTREAM_...; none: no key
          timeout_seconds: 600     # a whole request
          idle_timeout_seconds: 60 # the longest silence inside a stream
          max_inflight_per_endpoint: 64   # beyond it on every endpoint: 503 + Retry-After, never a queue
          retries: 2               # before the first byte only, on another endpoint
          health_interval_seconds: 5   # GET <endpoint>/models; 0: only failed requests mark an endpoint down
          routing: prefix          # prefix (same tenant and opening -> same endpoint) | least_outstanding
          context_length: 131072   # optional: what /v1/models advertises
          ca_file: /etc/inferflux/ca/fleet.pem   # optional: a private CA for https endpoints, under upstreams.ca_dir
    upstreams:              # what every model's upstream section may say (gateway.settings.upstreams)
      allowed_hosts: ["*.fleet.internal", 10.0.0.5, 10.0.0.6]   # names, *.domain, IPs, CIDRs; unset: public addresses only
      api_key_env_prefix: INFERFLUX_UPSTREAM_   # api_key_env may only name variables starting with this
      ca_dir: /etc/inferflux/ca   # ca_file may only name a file under it; unset: no ca_file
      forward_headers: [traceparent, tracestate]      # the only client headers passed upstream
    registry:               # model manifests (gateway.models.manifests; docs/operators.md#model-manifests)
      path: /etc/inferflux/models.d   # one YAML file a model (a models: entry); unset: none
      poll_interval_seconds: 5   # how often the directory is read (0.1 at least)
      max_manifest_bytes: 64KiB  # a larger file is reported as bad
    model_registry:         # the admin API's models, kept in the store and followed by every replica
      poll_seconds: 1       # how often the store is checked for models loaded, unloaded or made default elsewhere
    store:                  # the policy store (policy.store.StoreSettings)
      url: postgresql://inferflux@db/inferflux   # default: SQLite at <data_dir>/policy.db
      key_file: /run/secrets/store.key   # or passphrase; neither: <data_dir>/store.key, made on first start
      auto_migrate: true    # false: refuse to start on an outdated schema ('inferctl db upgrade')
      stale_seconds: 300    # store unreachable: cached decisions serve this long, then 503
    auth:
      cache_ttl_seconds: 30         # longest a cached authentication decision lives
      revocation_poll_seconds: 1    # how often the store is checked for revocations and role changes
      last_used_flush_seconds: 5    # how often API keys' last-used times are written
    console:                # the web console at /console (docs/operators.md#console)
      enabled: true         # false: /console is an unknown route, like any other (401 without credentials)
      session_seconds: 28800   # a console session's absolute lifetime
      idle_seconds: 1800    # it ends after this long without a request
      sign_in_failures: 5   # failed API-key sign-ins a source (address, IPv6 /64) may make in the window,
      sign_in_window_seconds: 60   # then 429 + Retry-After until the oldest leaves it
    websocket:              # /v1/websocket: streamed requests over one connection (docs/api.md#websocket)
      enabled: true         # false: no /v1/websocket route
      max_in_flight: 8      # requests running at once on one connection; one more gets a 429-shaped error event
      max_message_bytes: 4MiB   # a larger message gets a 413-shaped error event; over twice this, close 1009
      ping_interval_seconds: 20   # protocol pings; a peer silent as long again is closed
      idle_timeout_seconds: 300   # nothing in flight and nothing sent this long: closed (1000)
    ratelimit:              # the limits themselves are policies in the store (admin API)
      backend: memory       # memory (per process: N replicas admit N times each limit) | redis (use for replicas)
      redis_url: redis://127.0.0.1:6379/0
      fail_open: false      # Redis unreachable: false -> 503, true -> admit and count the failure
      completion_estimate: 256   # tokens reserved for a request that sets no max_tokens
    server:
      shutdown_grace_seconds: 20   # SIGTERM: in-flight requests get this long, then streams end with an error
      stream_write_timeout_seconds: 30   # a client that reads nothing this long: stream ended, its sequence freed
    audit:
      spool_dir: <data_dir>/audit   # one per replica; events are on disk here before a response
      chain_id: gw-1        # the spool's hash chain; default <hostname>-<random>; one per replica, never shared
      retention_days: 90    # rows older than this leave the audit_events table
      debug_content: false  # true: events carry the (redacted) prompt and completion text
      min_free_bytes: 32MiB # less free beside the spool: new work gets 503, /readyz fails
      sinks:                # each delivers the spool at least once, with its own cursor
        - {type: file, path: /var/log/inferflux/audit.jsonl}
        - {type: syslog, host: siem.example.com, port: 6514, transport: tls, ca_file: /etc/ssl/siem.pem}
        - {type: http, url: https://splunk:8088/services/collector/event, format: splunk_hec,
           token_env: SPLUNK_HEC_TOKEN}

Environment variables (each sets the key beside it):

    INFERFLUX_CONFIG                 the YAML file itself
    INFERFLUX_HOST                   host
    INFERFLUX_PORT                   port
    INFERFLUX_DATA_DIR               data_dir
    INFERFLUX_LOG_LEVEL              log_level
    INFERFLUX_LOG_FORMAT             log_format
    INFERFLUX_TRACING                tracing.enabled (true/false)
    INFERFLUX_WEBSOCKET              websocket.enabled (true/false)
    INFERFLUX_BACKEND                backend
    INFERFLUX_BACKEND_PRIORITY       runtime.backend_priority (comma separated)
    INFERFLUX_CPU_ISA                runtime.cpu_isa
    INFERFLUX_DTYPE                  dtype
    INFERFLUX_MODEL                  serve this one model (a path) instead of ``models``
    INFERFLUX_MODEL_NAME             the id clients use for INFERFLUX_MODEL
    INFERFLUX_KV_CACHE_BYTES         engine.kv_cache_bytes
    INFERFLUX_REGISTRY_PATH          registry.path
    INFERFLUX_REGISTRY_POLL_INTERVAL_SECONDS   registry.poll_interval_seconds
    INFERFLUX_MAX_BODY_BYTES         max_body_bytes
    INFERFLUX_MAX_QUEUED_SEQUENCES   max_queued_sequences
    INFERFLUX_MAX_QUEUED_SEQUENCES_PER_TENANT   max_queued_sequences_per_tenant
    INFERFLUX_STORE_URL              store.url
    INFERFLUX_STORE_KEY_FILE         store.key_file
    INFERFLUX_STORE_PASSPHRASE       store.passphrase
    INFERFLUX_RATELIMIT_BACKEND      ratelimit.backend
    INFERFLUX_REDIS_URL              ratelimit.redis_url

The top-level ``backend`` and ``dtype`` are defaults: a model entry in the
file that names its own keeps it, whatever the environment or flags say.
Sizes accept plain bytes or a unit: ``64MiB``, ``2GiB`` (powers of 1024) or
``4M``, ``1.5GB`` (powers of 1000).
Without any ``models`` the default SmolLM2 is served as
``smollm2-135m-instruct``.

The package: ``sections`` (the size and name types the sections share, and a
pydantic model per section of the gateway's own: console, auth, limits, audit,
server, tracing, input limits), ``engine`` (the sections of the inference
side: ``models`` entries, ``engine``, ``grammar``, ``runtime``), ``upstreams``
(the upstream sections and their least-privilege rules), ``schema``
(``Settings``, the top-level keys), ``loading`` (``load_settings``: the
layers, ``ENV_KEYS``, ``ConfigError``).
"""

from inferflux.gateway.settings.loading import ENV_KEYS, ConfigError, ensure_data_dir, load_settings
from inferflux.gateway.settings.schema import DEFAULT_MAX_BODY_BYTES, DEFAULT_MODEL_NAME, Settings, default_data_dir
from inferflux.gateway.settings.engine import (
    EmbeddingSettings,
    EngineSettings,
    ModelEntry,
    RuntimeSettings,
    SpeculativeSettings,
)
from inferflux.gateway.settings.sections import (
    AuditSettings,
    AuditSinkSettings,
    AuthSettings,
    ByteSize,
    Dtype,
    InputLimitSettings,
    LogLevel,
    ManifestRegistrySettings,
    ModelRegistrySettings,
    RateLimitSettings,
    ServerSettings,
    TracingSettings,
    WebSocketSettings,
    parse_size,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MODEL_NAME",
    "ENV_KEYS",
    "AuditSettings",
    "AuditSinkSettings",
    "AuthSettings",
    "ByteSize",
    "ConfigError",
    "Dtype",
    "EmbeddingSettings",
    "EngineSettings",
    "InputLimitSettings",
    "LogLevel",
    "ManifestRegistrySettings",
    "ModelEntry",
    "ModelRegistrySettings",
    "WebSocketSettings",
    "RateLimitSettings",
    "RuntimeSettings",
    "ServerSettings",
    "Settings",
    "SpeculativeSettings",
    "TracingSettings",
    "default_data_dir",
    "ensure_data_dir",
    "load_settings",
    "parse_size",
]
