"""Remote verifiers over HTTP: the verifiers (``http:``, ``disrm:``, ``genrm:``), their options,
the aiohttp transport, and the router that spreads calls over endpoints behind circuit breakers."""
