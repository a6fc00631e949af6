"""Structured outputs: generation held to a JSON schema, regex, choice or grammar (llguidance).

`compiler.GrammarCompiler` turns a request's `StructuredOutputs` into a checked, cached grammar
(the engine checks each request's before scheduling it: a 400 naming the field);
`sampling.StructuredSampling` keeps one matcher per request on the sampling stage and masks its
logits rows before the sampler draws.
"""
