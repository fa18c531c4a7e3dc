"""Generated Python bindings of the wire schema in ``proto/helios_core/wire``.

Do not edit the ``*_pb2`` modules: run ``python tools/gen_proto.py``.
"""
