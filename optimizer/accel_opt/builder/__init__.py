"""The orchestration: the order of a build's stages and their bodies that tie the layers below together (pipeline,
the build's context and samples, records and staging of the folder, the benchmark stage, the rescue search's actions,
the torch precision plan), `--precision auto` (auto, choice), `compare` (regression) and `doctor` (doctor, cpu_speed).
The only package that imports every layer; nothing below imports it. Import the modules, not this package's names."""
