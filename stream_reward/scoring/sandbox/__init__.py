"""The local code sandbox and the SandboxFusion client.

``scorer`` drives a sample's test cases; ``forms`` parses the task's test forms; ``slot``,
``isolation``, ``cgroups`` and ``seccomp`` build the wall around each candidate; ``wire`` is the
plain-data codec across it; ``_harness`` and ``_checker`` are the programs that run inside;
``judge`` compares; ``languages`` picks the code block and its language, ``compiled`` and
``polyglot`` compile (once per distinct program) and run the other languages; ``fusion`` calls
a SandboxFusion server instead.
"""
