"""Structured output: the constraint a request asks for (spec.py, pure) and the
grammar engine that turns it into a per-step token mask (grammar.py, llguidance).

The API process validates a constraint before a request is accepted (a bad schema
is the client's 400); the engine core compiles it into one matcher per sequence,
and the sampler masks each constrained row of the logits before it samples."""
