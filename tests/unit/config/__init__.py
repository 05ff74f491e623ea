"""The config package: schema (sections, per-field checks), loader (TOML, extends, CLI
overrides, --help, to_toml) and rules (cross-field rules, degrees)."""
