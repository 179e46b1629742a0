"""HTTP clients of rlpipe's long-lived services (rlpipe.services): the samplers' OpenAI-compatible
API and dev endpoints, the resident trainer's requests, and the JSON-over-HTTP both speak. Steps,
engines and rewards import these without importing what the services compute with."""
