"""Layer 4, the planners: ``planner(program, budget_bytes, device, *, copies, window) -> Plan``.

One module per planner; the shared pieces (candidate gaps, recompute chains,
pricing) in :mod:`~jaxmem._src.planners.common` and
:mod:`~jaxmem._src.planners.chains`, the protocol in
:mod:`~jaxmem._src.planners.protocol`, the registry by name in
:mod:`~jaxmem._src.planners.registry`.
"""
