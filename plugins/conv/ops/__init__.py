"""The conv plugin's ops, one file each; every module defines `SPECS`."""
