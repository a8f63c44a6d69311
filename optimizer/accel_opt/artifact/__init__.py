"""The artifact folder: what a build publishes and what proves it whole and whose it is.

- `folder`: atomic writes, content hashes, the manifest model, the hidden build folder, its lock and its publication
  by rename, the tools and command line recorded, the user cache folder.
- `records`: what a build writes into its folder (resource config, reports, probe set, manifest last) and the reuse
  of a finished, verified twin.
- `signing`: signatures over a folder (OpenSSF model-signing), on top of the manifest's hashes.
"""
