"""AutoFuser's bundled plugins, importable as ``autofuser_plugins.<name>``.

Each is loaded through the ``autofuser`` entry-point group, exactly like a
third party's plugin.
"""
