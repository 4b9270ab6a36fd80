"""The request path of the API calls that reach a model, as one package: a driver and its stages.

``run`` is the driver; every stage gets the request's ``Call`` (``call``). The
stages, in the order a chat completion meets them:

- ``body``: the JSON body decoded within its limits, then the size of its schemas, tools and
  guided constraints
- ``policy``: ``RequestPolicy``, step 1 (input guardrails)
- ``protocol``: the API's fields parsed and checked (``sampling``: the fields both generation
  APIs share; ``tools``: the tools and their history; ``completions``: what only the
  completions route has; ``json_schema``: a schema closed)
- ``policy`` step 2: the model allow-list, priority, weight, prefix-cache namespace
- ``plan``: the request's grammars compiled under the grammar budget first (``grammars``),
  then the prompt templated and tokenised into checked engine requests (``plan_remote``
  for a model an upstream serves)
- ``policy`` step 3: the queue, the limits, OPA; the engine starts
- ``generation``: the choices' outputs merged, the output guardrails (``tool_calls``: the text
  split into content and calls, by ``tool_parsers``)
- ``render``: the answer in the API's shape, one JSON body or SSE chunks
- ``sse``: the stream's response, and the client's disconnect watched
- ``policy`` step 4: the real token counts settled

``embeddings`` is the embeddings API's parse, plan, run and render; ``adapters`` turn the
Responses and Messages APIs' bodies into chat bodies and the chat answer back.
``token_text`` reads token-id prompts for the input guardrails.
"""
