"""Entry point of the `krex` command. Placeholder, replaced below."""
import click


@click.group()
def main() -> None:
    """KREX."""
