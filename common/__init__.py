"""Small pieces every part of the application shares: user errors, atomic writes, rank-aware logging."""
