"""Trainium support: instance topologies, the Neuron environment of a process, conformance
checks of a compiled program against Neuron's limits, and CPU emulation of a Neuron cluster.

    from neuron_support import topology, env, conformance, emulate

Nothing here needs the Neuron SDK: it is all tables, environment mapping and HLO text.
"""
