"""The engine core: the step loop (schedule, launch, finish, update), the scheduler and its requests, beam
search, grammars and the encoder cache's book; and the process that runs it behind the API server."""
