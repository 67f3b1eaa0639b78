"""Simulator of synchronous data-parallel training and projection of measured runs.

Modules, one concern each: ``compute`` (per-rank compute-time model), ``fabric`` (links,
hierarchy, all-reduce cost, contention), ``engine`` (the step loop, with the agent's pacing
controller in it), ``params`` (parameter sets; bundled ones in ``params/``), ``table1`` (baseline
vs pacing across node counts, beside the paper's Table 1), ``records`` (measured runs in and out),
``projection`` (fit a measured run, project it larger), ``stats``, ``progress``, ``plots`` and
``cli`` (the ``simulate`` and ``project`` subcommands). docs/simulator.md has the model.
"""
