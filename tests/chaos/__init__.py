"""The chaos harness (issue #7): mixed workflows on several real workers while a seeded
fault injector kills, freezes and restarts what they depend on."""
