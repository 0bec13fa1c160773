"""What a request asks of the engine, as data checked on the client: steering (`Steering`, `Ablate`, `Cap`, `Clamp`,
`Patch`), capture (`Capture`), SAEs (`SAE`), probes (`Probe`), metrics (`LogitDiff`, `Logprob`, `Recovered`) and the
values a harvest or a capture selects (`selection`).

This room sits below the root and the engines: they import it, it imports only the argument checks and
`components`' value names. Importing this package loads none of its modules.
"""
