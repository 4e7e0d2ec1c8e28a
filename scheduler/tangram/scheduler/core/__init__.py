"""The pure scheduler core: data in, decision out.

No I/O, no clock reads (time is an argument), no randomness. Everything the
service, the simulator and ``tangram explain`` decide goes through here.
"""
