"""Secondary tiers as the scheduler sees them: interface, factory, tiering manager."""
