"""The CPU's execution: settings (resolved once into the engine config), linear methods, row scales."""
